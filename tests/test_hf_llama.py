"""Hugging Face Llama in and out (mtnlg_jax/interop/hf_llama.py, launch/convert.py), against a
small random LlamaForCausalLM that transformers itself saved, with transformers' logits
(tests/fixtures/hf_llama, made by make_fixture.py there)."""

import json
import pathlib
import shutil
import sys

import jax
import ml_collections
import numpy as np
import pytest
import support

from mtnlg_jax import config as config_lib
from mtnlg_jax.checkpoint import slices
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.data import tokenizer as tokenizer_lib
from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.completion import Settings, complete
from mtnlg_jax.eval.generation import Generator
from mtnlg_jax.interop import hf_llama
from mtnlg_jax.interop import safetensors_files as st
from mtnlg_jax.model import gpt
from mtnlg_jax.train import resume
from mtnlg_jax.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'launch'))
import convert  # noqa: E402

FIXTURE = pathlib.Path(__file__).resolve().parent / 'fixtures' / 'hf_llama'
LLAMA31_CONFIG = json.loads((FIXTURE / 'llama31_config.json').read_text())
TRANSFORMERS_CONFIG = json.loads((FIXTURE / 'llama' / 'config.json').read_text())
PADDED_VOCAB = 384
VOCAB = 320
SAVED = np.load(FIXTURE / 'logits.npz')  # tokens (1, 48), transformers' logits (1, 48, 320)
# Our parameters of the fixture's Llama (GQA: q and kv apart; untied: output_embed).
PATHS = [
    ('token_embed',),
    ('output_embed',),
    ('final_norm', 'scale'),
    ('blocks', 'ln_attn', 'scale'),
    ('blocks', 'ln_mlp', 'scale'),
    ('blocks', 'attention', 'q_kernel'),
    ('blocks', 'attention', 'kv_kernel'),
    ('blocks', 'attention', 'out_kernel'),
    ('blocks', 'mlp', 'gate_kernel'),
    ('blocks', 'mlp', 'in_kernel'),
    ('blocks', 'mlp', 'out_kernel'),
]


def fixture_model_cfg():
    return ml_collections.ConfigDict(
        dict(hf_llama.model_keys(TRANSFORMERS_CONFIG), padded_vocab=PADDED_VOCAB, seq_len=64)
    )


def llama31_dir(tmp_path):
    """The fixture's weights beside the config.json the published Llama 3.1 checkpoints carry."""
    directory = tmp_path / 'llama31'
    shutil.copytree(FIXTURE / 'llama', directory)
    shutil.copy(FIXTURE / 'llama31_config.json', directory / 'config.json')
    return directory


def test_both_config_layouts_give_the_same_model_keys():
    keys = hf_llama.model_keys(TRANSFORMERS_CONFIG)
    assert 'rope_parameters' in TRANSFORMERS_CONFIG and 'rope_scaling' in LLAMA31_CONFIG
    assert hf_llama.model_keys(LLAMA31_CONFIG) == keys
    assert keys['rope_scaling'] == dict(
        type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=16
    )
    assert (keys['heads'], keys['kv_heads'], keys['head_dim'], keys['tie_embeddings']) == (
        4, 2, 8, False
    )  # fmt: skip
    assert (keys['rope_theta'], keys['norm'], keys['mlp'], keys['bias']) == (
        500000.0, 'rmsnorm', 'swiglu', False
    )  # fmt: skip


def test_our_export_config_reads_back_into_the_same_model_keys():
    cfg = fixture_model_cfg()
    cfg.update(dict(attention_dropout=0.0, init_std=0.02))
    exported = hf_llama.hf_config_of(cfg, bos_id=318, eos_id=319)
    assert hf_llama.model_keys(exported) == hf_llama.model_keys(TRANSFORMERS_CONFIG)


@pytest.mark.parametrize(
    'change, message',
    [
        (dict(hidden_act='gelu'), 'only silu'),
        (dict(rope_scaling=dict(rope_type='yarn', factor=4.0)), "rope type 'yarn'"),
        (dict(attention_bias=True), 'attention_bias and mlp_bias differ'),
        (dict(model_type='mistral', architectures=['MistralForCausalLM']), 'not a Llama'),
        (dict(hidden_size=None), 'no integer hidden_size'),
    ],
)
def test_configs_we_cannot_express_are_refused_with_the_reason(change, message):
    with pytest.raises(hf_llama.HFFormatError, match=message):
        hf_llama.model_keys(dict(LLAMA31_CONFIG, **change))


def read_all(directory, cfg):
    with st.Reader(directory) as reader:
        return {path: hf_llama.read_leaf(reader, path, cfg, PADDED_VOCAB, ()) for path in PATHS}


def test_hf_tensors_to_ours_and_back_are_bit_exact_from_either_file_layout():
    cfg = fixture_model_cfg()
    ours = read_all(FIXTURE / 'llama_sharded', cfg)
    assert ours[('blocks', 'attention', 'kv_kernel')].shape == (4, 32, 2, 2, 8)
    assert ours[('token_embed',)].shape == (PADDED_VOCAB, 32)
    assert not ours[('token_embed',)][320:].any()  # the padded rows are zero

    def get(path, layer):
        return ours[path] if layer is None else ours[path][layer]

    back = dict(hf_llama.hf_tensors(PATHS, get, cfg))
    with st.Reader(FIXTURE / 'llama') as reader:
        assert sorted(back) == reader.names()
        for name, value in back.items():
            np.testing.assert_array_equal(value, reader.read(name).astype(np.float32))
    first = list(back)[:2]
    assert first == ['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']


def test_q_and_k_rows_map_head_by_head_as_rotate_half_pairs_them():
    """Our q_kernel[e, h, d] is q_proj[h * D + d, e]: no rope permutation, since our rope
    pairs channel d with d + D / 2 as Hugging Face's rotate_half does (model/rope.py)."""
    cfg = fixture_model_cfg()
    with st.Reader(FIXTURE / 'llama') as reader:
        q = reader.read('model.layers.1.self_attn.q_proj.weight').astype(np.float32)
        k = reader.read('model.layers.1.self_attn.k_proj.weight').astype(np.float32)
        ours_q = hf_llama.read_leaf(reader, PATHS[5], cfg, PADDED_VOCAB, (slice(1, 2),))[0]
        ours_kv = hf_llama.read_leaf(reader, PATHS[6], cfg, PADDED_VOCAB, (slice(1, 2),))[0]
    np.testing.assert_array_equal(ours_q[5, 3, 6], q[3 * 8 + 6, 5])
    np.testing.assert_array_equal(ours_kv[7, 0, 1, 2], k[1 * 8 + 2, 7])


@pytest.mark.parametrize('path', PATHS)
def test_a_devices_slice_reads_as_that_slice_of_the_whole_leaf(path):
    cfg = fixture_model_cfg()
    whole = read_all(FIXTURE / 'llama', cfg)[path]
    rng = np.random.default_rng(len(path[-1]))
    with st.Reader(FIXTURE / 'llama') as reader:
        for _ in range(4):
            index = []
            for n in whole.shape:
                start = int(rng.integers(0, n))
                index.append(slice(start, int(rng.integers(start + 1, n + 1))))
            part = hf_llama.read_leaf(reader, path, cfg, PADDED_VOCAB, tuple(index))
            np.testing.assert_array_equal(part, whole[tuple(index)])


# ---- the fixture imported into our model (launch/convert.py), against transformers' logits


def import_config(data=4, stage=1, tensor=2, repeats=1, seq_len=None):
    config = config_lib.load(str(ROOT / 'configs/gpt2_124m.py'))
    config.model.compute_dtype = 'float32'
    config.mesh.update(dict(data=data, stage=stage, tensor=tensor))
    config.pipeline.update(dict(repeats=repeats, schedule='interleaved' if repeats > 1 else '1f1b'))
    config.train.update(dict(global_batch=data * 4, micro_batch=1))
    if seq_len:
        config.model.seq_len = seq_len
    return config


def import_fixture(hf_dir, workdir, config, overrides=None):
    convert.import_hf(str(hf_dir), str(workdir), config, overrides=overrides or {})
    return workdir


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
    """The fixture (transformers 5's config.json) imported under data 4 x tensor 2."""
    root = tmp_path_factory.mktemp('llama')
    return import_fixture(FIXTURE / 'llama', root / 'imported', import_config())


def our_logits(workdir, tokens, data=4, tensor=2):
    loaded = workdir_lib.load(str(workdir), data=data, tensor=tensor, dtype='float32')
    model = gpt.merge(loaded.graphdef, loaded.params)
    with jax.set_mesh(loaded.mesh):
        logits = jax.jit(lambda t: model.logits(model(t)))(np.repeat(tokens, data, axis=0))
    return np.asarray(logits[0, :, :VOCAB]), loaded


def assert_same_parameters(workdir_a, workdir_b):
    """The two workdirs' parameters equal bit for bit (the vocabulary tables up to the real
    vocabulary: the padding follows each run's tensor size)."""
    a, b = (
        jax.device_get(workdir_lib.load(str(w), data=1, tensor=1, dtype='float32').params)
        for w in (workdir_a, workdir_b)
    )
    for key in ('token_embed', 'output_embed'):
        a[key], b[key] = a[key][:VOCAB], b[key][:VOCAB]
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_imported_logits_equal_transformers_under_tensor_2(imported):
    logits, loaded = our_logits(imported, SAVED['tokens'])
    assert (loaded.config.model.kv_heads, loaded.config.model.position) == (2, 'rope')
    np.testing.assert_allclose(logits, SAVED['logits'][0], atol=1e-4, rtol=0)


@pytest.mark.parametrize('layout', ['llama31_config', 'sharded'])
def test_the_other_file_layouts_import_into_the_same_parameters(imported, tmp_path, layout):
    hf_dir = llama31_dir(tmp_path) if layout == 'llama31_config' else FIXTURE / 'llama_sharded'
    assert_same_parameters(
        imported, import_fixture(hf_dir, tmp_path / 'w', import_config(data=8, tensor=1))
    )


def pipelined_loss_against_transformers(workdir, saved, seq_len):
    """(the eval step's mean loss of the fixture's first seq_len + 1 tokens, every row of the
    batch those, on the workdir's checkpoint under its own layout; the cross-entropy of
    transformers' logits `saved` for them)."""
    config = config_lib.resolve(
        config_lib.inputs_of(json.loads((workdir / 'config.json').read_text())['inputs']), 8
    )
    mesh, setup = support.layout(config)
    checkpoints = checkpoint_lib.Checkpoints(str(workdir), read_only=True)
    _, state, _ = resume._restore_newest(config, checkpoints, setup)
    checkpoints.close()
    tokens = saved['tokens'][:, : seq_len + 1]
    batch = np.repeat(tokens, config.train.global_batch, axis=0)
    with jax.set_mesh(mesh):
        micro_steps = batch_lib.to_micro_steps(batch, config.train.micro_steps)
        batch, _ = batch_lib.place_batch(*micro_steps, mesh)
        eval_step = step_lib.make_eval_step(config, setup)
        loss_sum, count = eval_step(state['params'], batch, state.get('buffers'))
    assert float(count) == seq_len * config.train.global_batch
    logits = saved['logits'][0, :seq_len].astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    theirs = (log_z - logits[np.arange(seq_len), tokens[0, 1:]]).mean()
    return float(loss_sum) / float(count), theirs


def test_the_loss_under_an_interleaved_pipeline_equals_transformers(tmp_path):
    """data 2 x stage 2 x tensor 2, two chunks a stage: the eval step's pipelined loss of the
    fixture's tokens is the cross-entropy of transformers' logits."""
    config = import_config(data=2, stage=2, tensor=2, repeats=2, seq_len=32)
    # Not sequence parallel: the pipelined eval step under it waits forever on XLA:CPU, for the
    # GPT block too (reported; the train step is fine).
    config.model.sequence_parallel = False
    workdir = import_fixture(FIXTURE / 'llama', tmp_path / 'w', config, {'model.seq_len': '32'})
    ours, theirs = pipelined_loss_against_transformers(workdir, SAVED, 32)
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_export_then_import_is_bit_exact_and_transformers_reloads_it(
    imported, tmp_path, monkeypatch
):
    """Export (fp32 shards of at most 60 KB and their index, the run's tokenizer beside them)
    reads back into the same parameters, having read the checkpoint's files one layer of one
    parameter at a time; the same directory loads in transformers into the fixture's logits
    (make_fixture.py --check-export, outside the suite: it needs torch)."""
    out, reads, read = tmp_path / 'out', [], slices.LayerReader.__call__

    def recorded(self, path, layer=None):
        value = read(self, path, layer)
        reads.append((path, layer, value.nbytes))
        return value

    monkeypatch.setattr(slices.LayerReader, '__call__', recorded)
    convert.export_hf(str(out), str(imported), None, shard_bytes=60_000)
    layers = TRANSFORMERS_CONFIG['num_hidden_layers']
    blocks = [(path, layer) for path, layer, _ in reads if path[0] == 'blocks']
    assert len(blocks) == layers * len({path for path, _ in blocks})  # each leaf, layer by layer
    assert all(layer is not None for _, layer in blocks)
    largest_leaf = max(nbytes for path, _, nbytes in reads if path[0] != 'blocks')
    assert max(nbytes for *_, nbytes in reads) <= largest_leaf  # never a stacked leaf whole
    shards = sorted(set(json.loads((out / st.INDEX).read_text())['weight_map'].values()))
    assert shards == [f'model-0000{i}-of-00005.safetensors' for i in range(1, 6)]
    assert sorted(p.name for p in out.iterdir()) == sorted(shards + [
        'config.json', st.INDEX, 'special_tokens_map.json', 'tokenizer.json',
        'tokenizer_config.json',
    ])  # fmt: skip
    exported = json.loads((out / 'config.json').read_text())
    assert hf_llama.model_keys(exported) == hf_llama.model_keys(TRANSFORMERS_CONFIG)
    assert (exported['bos_token_id'], exported['eos_token_id']) == (318, 319)
    with st.Reader(FIXTURE / 'llama') as original, st.Reader(out) as reader:
        assert reader.names() == original.names()
        for name in reader.names():
            np.testing.assert_array_equal(reader.read(name), original.read(name).astype(np.float32))
    assert_same_parameters(imported, import_fixture(out, tmp_path / 'again', import_config()))


def test_generation_from_the_import_starts_with_bos_and_gives_transformers_argmax(imported):
    """KV-cache generation on the import with its tokenizer.json: the prompt starts with Llama
    3's BOS (as its documents did), and the greedy continuation is transformers' argmax (the
    prompt is the fixture's first 20 tokens, so the new token is the argmax of the fixture's
    logits at position 19)."""
    tok = tokenizer_lib.load(str(FIXTURE / 'llama' / 'tokenizer.json'))
    prompt = tok.decode(SAVED['tokens'][0, 1:20])  # the fixture's text after its BOS
    assert tok.encode_prompt(prompt) == SAVED['tokens'][0, :20].tolist()
    loaded = workdir_lib.load(str(imported), data=1, tensor=2, dtype='float32')
    generator = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    [[completion]] = complete(generator, tok, [prompt], Settings(max_new_tokens=1))
    assert completion.tokens == [int(SAVED['logits'][0, 19].argmax())]


def convert_main(capsys, *args):
    """launch/convert.py's main in this process: (exit status, stderr lines)."""
    return support.main_in_process(convert.main, capsys, *args)


@pytest.mark.parametrize(
    'override, message',
    [
        ('--config.model.kv_heads=4', 'config.json gives model.kv_heads = 2'),
        ('--config.model.rope_scaling.factor=4.0', 'config.json gives model.rope_scaling = {'),
        ('--config.model.tie_embeddings=true', 'config.json gives model.tie_embeddings = False'),
        ('--config.model.seq_len=128', 'has max_position_embeddings 64'),
    ],
)
def test_an_import_refuses_overrides_its_config_json_contradicts(tmp_path, capsys, override,
                                                                 message):  # fmt: skip
    status, err = convert_main(
        capsys, '--import_hf', FIXTURE / 'llama', '--workdir', tmp_path / 'w', override
    )
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f'error: {override}') and message in err[0], err
    assert not (tmp_path / 'w').exists()


def broken_copies(tmp_path):
    """HF directories each broken one way: (directory, what the error line must say)."""
    cases = []

    def copy(name, config=None, drop=(), add=()):
        directory = tmp_path / name
        shutil.copytree(FIXTURE / 'llama', directory)
        if config:
            (directory / 'config.json').write_text(json.dumps(dict(TRANSFORMERS_CONFIG, **config)))
        if drop or add:
            with st.Reader(directory) as reader:
                tensors = {n: reader.read(n) for n in reader.names() if n not in drop}
            (directory / st.SINGLE).unlink()
            st.write(directory, list(tensors.items()) + list(add))
        return directory

    up = 'model.layers.3.mlp.up_proj.weight'
    cases.append((copy('missing', drop=[up]), f'no tensor {up}'))
    wider = copy('shape', config=dict(intermediate_size=96))
    cases.append((wider, 'is (64, 32), config.json says'))
    q_norm = ('model.layers.0.self_attn.q_norm.weight', np.ones(8, np.float32))
    cases.append((copy('extra', add=[q_norm]), 'have no place in this Llama'))
    index = copy('index')
    with st.Reader(index) as reader:
        weight_map = {name: st.SINGLE for name in reader.names()}
    weight_map['lm_head.weight'] = 'gone.safetensors'
    (index / st.INDEX).write_text(json.dumps({'weight_map': weight_map}))
    cases.append((index, 'gone.safetensors: no such file'))
    cases.append((copy('rope', config=dict(rope_parameters=dict(rope_type='yarn', rope_theta=1.0))),
                  "rope type 'yarn'"))  # fmt: skip
    return cases


def test_bad_model_directories_are_one_error_line_and_nothing_written(tmp_path, capsys):
    for directory, message in broken_copies(tmp_path):
        workdir = tmp_path / f'w_{directory.name}'
        status, err = convert_main(capsys, '--import_hf', directory, '--workdir', workdir)
        assert status == 2 and len(err) == 1, (directory.name, err)
        assert err[0].startswith(f'error: --import_hf {directory}') and message in err[0], err
        assert not workdir.exists()


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--import_hf', FIXTURE / 'llama', '--dtype', 'bfloat16'], '--dtype goes with'),
        (['--export_hf', 'OUT', '--shard_size', '5XB'], '--shard_size 5XB: give bytes'),
        (['--import_hf', FIXTURE], f'--import_hf {FIXTURE}: no config.json in it'),
    ],
)
def test_bad_convert_flags_are_one_error_line(tmp_path, capsys, flags, message):
    flags = [tmp_path / 'out' if f == 'OUT' else f for f in flags]
    status, err = convert_main(capsys, *flags, '--workdir', tmp_path / 'w')
    assert status == 2 and len(err) == 1 and err[0].startswith(f'error: {message}'), err
    assert not (tmp_path / 'w').exists() and not (tmp_path / 'out').exists()
