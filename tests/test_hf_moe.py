"""Hugging Face Mixtral, Qwen3-MoE and Qwen3 in and out (mtnlg_jax/interop/hf_variants.py,
hf_llama.py's tensors, launch/convert.py), against small random models transformers itself
saved, with transformers' logits (tests/fixtures/hf_moe, made by make_fixture.py there)."""

import hashlib
import json
import pathlib
import shutil

import ml_collections
import numpy as np
import pytest
from test_hf_llama import (
    assert_same_parameters,
    convert,
    convert_main,
    import_config,
    our_logits,
    pipelined_loss_against_transformers,
)

from mtnlg_jax.checkpoint import slices
from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.generation import Generator
from mtnlg_jax.interop import hf_llama, hf_variants
from mtnlg_jax.interop import safetensors_files as st

FIXTURE = pathlib.Path(__file__).resolve().parent / 'fixtures' / 'hf_moe'
MODELS = ('mixtral', 'qwen3_moe', 'qwen3')
CLASSES = dict(mixtral='MixtralForCausalLM', qwen3_moe='Qwen3MoeForCausalLM',
               qwen3='Qwen3ForCausalLM')  # fmt: skip
PADDED_VOCAB = 384


def transformers_config(name):
    """config.json as transformers 5 wrote it."""
    return json.loads((FIXTURE / name / 'config.json').read_text())


def published_config(name):
    """The same model's config.json as the published checkpoints spell it."""
    return json.loads((FIXTURE / f'{name}_published.json').read_text())


def saved(name):
    return np.load(FIXTURE / f'{name}_logits.npz')  # tokens (1, 48), logits (1, 48, 320)


def model_cfg_of(name):
    keys = hf_variants.model_keys(transformers_config(name))
    return ml_collections.ConfigDict(dict(keys, padded_vocab=PADDED_VOCAB, seq_len=64))


def published_dir(tmp_path, name):
    directory = tmp_path / f'{name}_published'
    shutil.copytree(FIXTURE / name, directory)
    shutil.copy(FIXTURE / f'{name}_published.json', directory / 'config.json')
    return directory


def test_both_config_layouts_give_the_same_model_keys():
    assert 'num_local_experts' in transformers_config('qwen3_moe')  # transformers 5's spelling
    assert 'num_experts' in published_config('qwen3_moe')  # Qwen's
    for name in MODELS:
        keys = hf_variants.model_keys(transformers_config(name))
        assert 'rope_parameters' in transformers_config(name)
        assert 'rope_theta' in published_config(name)
        assert hf_variants.model_keys(published_config(name)) == keys, name
        assert hf_llama.architecture(ml_collections.ConfigDict(keys)) == CLASSES[name]
    mixtral, qwen3_moe, qwen3 = (hf_variants.model_keys(transformers_config(n)) for n in MODELS)
    assert mixtral['moe'] == dict(
        experts=4, top_k=2, ffn_hidden=48, shared_experts=0, shared_ffn_hidden=0,
        dense_layers=0, router='softmax', norm_top_k=True,
    )  # fmt: skip
    assert (mixtral['qk_norm'], mixtral['head_dim'], mixtral['rope_theta']) == (False, 8, 1e6)
    assert (qwen3_moe['moe']['ffn_hidden'], qwen3_moe['ffn_hidden']) == (24, 64)
    assert (qwen3_moe['moe']['norm_top_k'], qwen3_moe['qk_norm'], qwen3_moe['head_dim']) == (
        False, True, 16
    )  # fmt: skip
    assert (qwen3['moe'], qwen3['qk_norm'], qwen3['tie_embeddings']) == (
        dict(experts=0), True, True
    )  # fmt: skip


@pytest.mark.parametrize('name', MODELS)
def test_our_export_config_reads_back_into_the_same_model_keys(name):
    cfg = model_cfg_of(name)
    cfg.update(dict(attention_dropout=0.0, init_std=0.02))
    cfg.moe.update(dict(aux_loss_coeff=0.01, bias_update_rate=0.0, capacity_factor=0.0))
    assert hf_variants.unexportable(cfg) is None
    exported = hf_variants.hf_config_of(cfg, bos_id=318, eos_id=319)
    assert exported['architectures'] == [CLASSES[name]]
    assert hf_variants.model_keys(exported) == hf_variants.model_keys(transformers_config(name))


def test_an_export_with_a_routed_scale_is_refused_in_one_line():
    """model.moe.routed_scale other than 1: neither Mixtral nor Qwen3-MoE scales its routed
    weights, so the export says so (the router's other keys' way)."""
    cfg = model_cfg_of('mixtral')
    cfg.moe.routed_scale = 2.5
    assert hf_variants.unexportable(cfg) == (
        'model.moe.routed_scale = 2.5: MixtralForCausalLM scales no routed weight'
    )


@pytest.mark.parametrize(
    'name, change, message',
    [
        ('mixtral', dict(sliding_window=4096), 'config.json sliding_window = 4096'),
        ('mixtral', dict(router_jitter_noise=0.1), 'config.json router_jitter_noise = 0.1'),
        ('mixtral', dict(num_experts_per_tok=5), 'num_experts_per_tok = 5 > 4 experts'),
        ('mixtral', dict(num_local_experts=None), 'num_local_experts = None'),
        ('qwen3_moe', dict(decoder_sparse_step=2), 'config.json decoder_sparse_step = 2'),
        ('qwen3_moe', dict(mlp_only_layers=[1]), 'config.json mlp_only_layers = [1]'),
        ('qwen3_moe', dict(mlp_only_layers=[0, 1, 2]), 'no layer left for the experts'),
        ('qwen3_moe', dict(moe_intermediate_size=None), 'moe_intermediate_size = None: a positive'),
        ('qwen3_moe', dict(shared_expert_intermediate_size=8), 'shared_expert_intermediate_size'),
        ('qwen3', dict(use_sliding_window=True), 'config.json use_sliding_window = True'),
        ('qwen3', dict(layer_types=['sliding_attention'] * 2), 'config.json layer_types'),
        ('qwen3', dict(hidden_act='gelu'), 'only silu'),
    ],
)
def test_configs_we_cannot_represent_are_refused_naming_the_key(name, change, message):
    config = {k: v for k, v in transformers_config(name).items() if v is not None or k in change}
    with pytest.raises(hf_llama.HFFormatError, match=message.replace('[', r'\[')):
        hf_variants.model_keys(dict(config, **change))


def test_experts_read_per_expert_and_write_back_bit_exact_from_either_file_layout():
    cfg = model_cfg_of('mixtral')
    paths = [p for p in hf_llama.leaves(cfg) if p[0] != 'blocks' or p[1] in ('moe', 'ln_attn')]
    paths += [('blocks', 'ln_mlp', 'scale')] + [
        ('blocks', 'attention', name) for name in ('q_kernel', 'kv_kernel', 'out_kernel')
    ]
    with st.Reader(FIXTURE / 'mixtral_sharded') as reader:
        ours = {p: hf_llama.read_leaf(reader, p, cfg, PADDED_VOCAB, ()) for p in paths}
        w1 = reader.read('model.layers.1.block_sparse_moe.experts.2.w1.weight')
        w2 = reader.read('model.layers.1.block_sparse_moe.experts.3.w2.weight')
        gate = reader.read('model.layers.0.block_sparse_moe.gate.weight')
    assert ours[('blocks', 'moe', 'gate_kernel')].shape == (2, 4, 32, 48)
    np.testing.assert_array_equal(ours[('blocks', 'moe', 'gate_kernel')][1, 2], w1.T)
    np.testing.assert_array_equal(ours[('blocks', 'moe', 'out_kernel')][1, 3], w2.T)
    np.testing.assert_array_equal(ours[('blocks', 'moe', 'router_kernel')][0], gate.T)
    back = dict(hf_llama.hf_tensors(paths, lambda p, i: ours[p] if i is None else ours[p][i], cfg))
    with st.Reader(FIXTURE / 'mixtral') as reader:
        assert sorted(back) == reader.names()
        for name, value in back.items():
            np.testing.assert_array_equal(value, reader.read(name).astype(np.float32))


@pytest.mark.parametrize(
    'name, stacks',
    [('qwen3_moe', dict(dense_blocks=[0], blocks=[1, 2])), ('qwen3', dict(blocks=[0, 1]))],
)
def test_q_and_k_norms_read_as_qk_norm_rows(name, stacks):
    """Each of our stacks' rows is its Hugging Face layer's q and k norms: Qwen3-MoE's
    mlp_only_layers [0] is our dense stack (model.moe.dense_layers 1), its layers 1 and 2
    our blocks."""
    cfg = model_cfg_of(name)
    assert cfg.get('moe', {}).get('dense_layers', 0) == len(stacks.get('dense_blocks', []))
    with st.Reader(FIXTURE / name) as reader:
        for stack, layers in stacks.items():
            ours = hf_llama.read_leaf(reader, (stack, 'attention', 'qk_norm'), cfg, 384, ())
            assert ours.shape == (len(layers), 2, 16)
            for row, layer in enumerate(layers):
                q, k = (
                    reader.read(f'model.layers.{layer}.self_attn.{n}_norm.weight') for n in 'qk'
                )
                np.testing.assert_array_equal(ours[row], np.stack([q, k]).astype(np.float32))


def test_a_devices_experts_are_read_as_its_slice_of_the_whole_leaf():
    """A device holding experts 1 and 2 of the MoE stack's second layer (Hugging Face's layer
    2: layer 0 is dense) and half their width reads only those."""
    cfg = model_cfg_of('qwen3_moe')
    path = ('blocks', 'moe', 'in_kernel')
    index = (slice(1, 2), slice(1, 3), slice(None), slice(12, 24))
    with st.Reader(FIXTURE / 'qwen3_moe') as reader:
        whole = hf_llama.read_leaf(reader, path, cfg, PADDED_VOCAB, ())
        names, read = [], reader.read

        def recorded(name, index=()):
            names.append(name)
            return read(name, index)

        reader.read = recorded
        part = hf_llama.read_leaf(reader, path, cfg, PADDED_VOCAB, index)
    np.testing.assert_array_equal(part, whole[index])
    assert names == [f'model.layers.2.mlp.experts.{j}.up_proj.weight' for j in (1, 2)]


# ---- imported into our model (launch/convert.py), against transformers' logits


def moe_import_config(data=4, tensor=2):
    return import_config(data=data, tensor=tensor)


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
    """Each fixture (transformers 5's config.json) imported under data 4 x tensor 2."""
    root = tmp_path_factory.mktemp('moe')
    workdirs = {}
    for name in MODELS:
        workdirs[name] = root / name
        convert.import_hf(str(FIXTURE / name), str(workdirs[name]), moe_import_config())
    return workdirs


@pytest.mark.parametrize('name', MODELS)
def test_imported_logits_equal_transformers_under_tensor_2(imported, name):
    logits, loaded = our_logits(imported[name], saved(name)['tokens'])
    assert loaded.config.model.moe.experts == (0 if name == 'qwen3' else 4)
    difference = np.abs(logits - saved(name)['logits'][0]).max()
    print(f'{name}: max |our logits - transformers logits| = {difference:.3g}')
    np.testing.assert_allclose(logits, saved(name)['logits'][0], atol=1e-4, rtol=0)


@pytest.mark.parametrize('name', ['mixtral', 'qwen3_moe'])
def test_kv_cache_generation_from_the_import_starts_with_transformers_argmax(imported, name):
    """Greedy generation on the import: the first new token after the fixture's first 20 is
    the argmax of transformers' logits at position 19, and the cached decode (one token a
    step through the experts) gives what recomputing the whole sequence gives."""
    loaded = workdir_lib.load(str(imported[name]), data=1, tensor=2, dtype='float32')
    generator = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    prompt = saved(name)['tokens'][0, :20].tolist()
    [cached] = generator([prompt], 6)
    [recomputed] = generator([prompt], 6, use_cache=False)
    assert cached[0] == int(saved(name)['logits'][0, 19].argmax())
    assert cached == recomputed


@pytest.mark.parametrize(
    'name, layout', [('mixtral', 'sharded'), ('mixtral', 'published'), ('qwen3_moe', 'published')]
)
def test_the_other_file_layouts_import_into_the_same_parameters(imported, tmp_path, name, layout):
    """Sharded files and the published config.json, under data 8 (tensor 1: the experts
    whole on each device, not split over their width), give the same parameters."""
    if layout == 'sharded':
        hf_dir = FIXTURE / f'{name}_sharded'
    else:
        hf_dir = published_dir(tmp_path, name)
    config = moe_import_config(data=8, tensor=1)
    convert.import_hf(str(hf_dir), str(tmp_path / 'w'), config)
    assert_same_parameters(imported[name], tmp_path / 'w')


@pytest.fixture(scope='module')
def exports(imported, tmp_path_factory):
    """Each imported fixture exported (fp32) by launch/convert.py --export_hf's function."""
    root = tmp_path_factory.mktemp('exports')
    for name in MODELS:
        convert.export_hf(str(root / name), str(imported[name]), None)
    return {name: root / name for name in MODELS}


@pytest.mark.parametrize('name', MODELS)
def test_export_writes_the_hub_layout_back_bit_exact(exports, name):
    """Export (fp32) writes the fixture's tensors under the fixture's names (the experts one
    tensor each) and a config.json that reads back into the same keys."""
    out = exports[name]
    exported = json.loads((out / 'config.json').read_text())
    assert exported['architectures'] == [CLASSES[name]]
    assert hf_variants.model_keys(exported) == hf_variants.model_keys(transformers_config(name))
    with st.Reader(FIXTURE / name) as original, st.Reader(out) as reader:
        assert reader.names() == original.names()
        for tensor in reader.names():
            np.testing.assert_array_equal(
                reader.read(tensor), original.read(tensor).astype(np.float32)
            )


def test_transformers_reloaded_these_very_exports_into_its_logits(exports):
    """transformers loaded what this suite's export writes, file for file, into the saved
    logits: exported.json is what make_fixture.py --check-export printed for each export
    (torch is no dependency: it ran outside the suite), with the sha256 of every file it
    loaded. An export that writes other bytes than transformers checked fails here until
    the check is run again on it."""
    checks = {c['model']: c for c in json.loads((FIXTURE / 'exported.json').read_text())}
    assert sorted(checks) == sorted(MODELS)
    for name, check in checks.items():
        assert check['architecture'] == CLASSES[name]
        assert check['max_abs_logit_difference'] < 1e-4, check
        written = {
            path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(exports[name].iterdir())
        }
        assert written == check['files'], name


def with_moe_keys(tmp_path, workdir, **moe):
    """A copy of `workdir` whose config.json has these model.moe keys."""
    copy = tmp_path / 'w'
    shutil.copytree(workdir, copy)
    saved_config = json.loads((copy / 'config.json').read_text())
    saved_config['inputs']['model']['moe'].update(moe)
    (copy / 'config.json').write_text(json.dumps(saved_config))
    return copy


def test_a_model_no_hugging_face_class_holds_is_one_export_error_line(imported, tmp_path, capsys):
    workdir = with_moe_keys(tmp_path, imported['mixtral'], router='sigmoid')
    status, err = convert_main(capsys, '--export_hf', tmp_path / 'out', '--workdir', workdir)
    assert status == 2 and len(err) == 1, err
    assert "model.moe.router = 'sigmoid': MixtralForCausalLM routes by softmax" in err[0], err
    assert not (tmp_path / 'out').exists()


def test_a_router_bias_that_moved_is_refused_at_export_one_that_did_not_is_not(
    imported, tmp_path, capsys, monkeypatch
):
    """The checkpoint's router_bias decides, not the rate: a run with bias_update_rate set
    whose bias is still 0 exports; one whose bias moved (read from the checkpoint as any
    parameter) is one error line, since transformers' router would choose other experts."""
    workdir = with_moe_keys(tmp_path, imported['qwen3_moe'], bias_update_rate=0.01)
    convert.export_hf(str(tmp_path / 'out'), str(workdir), None)
    assert (tmp_path / 'out' / 'config.json').exists()
    read = slices.LayerReader.__call__

    def moved(self, path, layer=None):
        value = read(self, path, layer)
        return value + 0.25 if self.section == 'buffers' else value

    monkeypatch.setattr(slices.LayerReader, '__call__', moved)
    status, err = convert_main(capsys, '--export_hf', tmp_path / 'out2', '--workdir', workdir)
    assert status == 2 and len(err) == 1, err
    assert (
        f'--workdir {workdir} step 0: the router bias (model.moe.bias_update_rate) has '
        'moved, up to 0.25: Qwen3MoeForCausalLM has none' in err[0]
    ), err
    assert not (tmp_path / 'out2').exists()


def test_a_missing_expert_or_an_unrepresentable_config_is_one_import_error_line(tmp_path, capsys):
    missing = tmp_path / 'missing'
    shutil.copytree(FIXTURE / 'mixtral', missing)
    with st.Reader(missing) as reader:
        gone = 'model.layers.1.block_sparse_moe.experts.3.w3.weight'
        tensors = [(n, reader.read(n)) for n in reader.names() if n != gone]
    (missing / st.SINGLE).unlink()
    st.write(missing, tensors)
    cases = [(missing, f'no tensor {gone}')]
    for case, change, message in (
        ('jitter', dict(router_jitter_noise=0.01), 'router_jitter_noise = 0.01'),
        ('deepseek', dict(model_type='deepseek_v3', architectures=['DeepseekV3ForCausalLM']),
         "config.json model_type 'deepseek_v3': only gpt2, llama, qwen3, mixtral, qwen3_moe"),
    ):  # fmt: skip
        directory = tmp_path / case
        shutil.copytree(FIXTURE / 'mixtral', directory)
        config = dict(transformers_config('mixtral'), **change)
        (directory / 'config.json').write_text(json.dumps(config))
        cases.append((directory, message))
    for directory, message in cases:
        workdir = tmp_path / f'w_{directory.name}'
        status, err = convert_main(capsys, '--import_hf', directory, '--workdir', workdir)
        assert status == 2 and len(err) == 1, err
        assert err[0].startswith(f'error: --import_hf {directory}') and message in err[0], err
        assert not workdir.exists()


@pytest.mark.parametrize(
    'override, message',
    [
        ('--config.model.moe.top_k=1', 'config.json gives model.moe = {'),
        ('--config.model.moe.experts=8', "'experts': 4"),
        ('--config.model.qk_norm=true', 'config.json gives model.qk_norm = False'),
    ],
)
def test_an_import_refuses_moe_overrides_its_config_json_contradicts(tmp_path, capsys, override,
                                                                     message):  # fmt: skip
    status, err = convert_main(
        capsys, '--import_hf', FIXTURE / 'mixtral', '--workdir', tmp_path / 'w', override
    )
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f'error: {override}') and message in err[0], err
    assert not (tmp_path / 'w').exists()


def test_the_loss_under_a_pipeline_equals_transformers(tmp_path):
    """Qwen3-MoE under data 2 x stage 2 x tensor 2, its dense layer 0 ahead of the stages and
    an MoE layer a stage: the eval step's pipelined loss of the fixture's tokens is the
    cross-entropy of transformers' logits."""
    config = import_config(data=2, stage=2, tensor=2, seq_len=32)
    config.model.sequence_parallel = False  # as test_hf_llama.py's pipeline test says
    workdir = tmp_path / 'w'
    convert.import_hf(
        str(FIXTURE / 'qwen3_moe'), str(workdir), config, overrides={'model.seq_len': '32'}
    )
    ours, theirs = pipelined_loss_against_transformers(workdir, saved('qwen3_moe'), 32)
    assert ours == pytest.approx(theirs, abs=1e-5)
