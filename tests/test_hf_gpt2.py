"""Hugging Face GPT-2 interop: a small random GPT-2 in Hugging Face's exact file format is
imported, its logits checked against an independent numpy forward of HF's GPT2LMHeadModel,
exported back bit for bit, evaluated under two layouts, and trained further by
launch/train.py from the imported weights."""

import contextlib
import io
import json
import math
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

from mtnlg_jax import config as config_lib
from mtnlg_jax.interop import hf_gpt2
from mtnlg_jax.data.indexed import IndexedDatasetWriter
from mtnlg_jax.data.loader import open_datasets
from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.scoring import Scorer
from mtnlg_jax.model import gpt

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'launch'))
import convert  # noqa: E402

HF_CONFIG = dict(
    architectures=['GPT2LMHeadModel'],
    model_type='gpt2',
    activation_function='gelu_new',
    n_embd=64,
    n_layer=2,
    n_head=8,
    n_positions=32,
    n_ctx=32,
    vocab_size=300,  # like GPT-2's 50257: not a multiple of 128, padded on import
    layer_norm_epsilon=1e-5,
    initializer_range=0.02,
    attn_pdrop=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
)


def random_hf_tensors(seed=0, prefix=''):
    """Every tensor of a GPT2LMHeadModel's model.safetensors, HF names and (Conv1D) shapes."""
    rng = np.random.default_rng(seed)
    e, v, p = HF_CONFIG['n_embd'], HF_CONFIG['vocab_size'], HF_CONFIG['n_positions']

    def normal(*shape, std=0.2):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    tensors = {'wte.weight': normal(v, e), 'wpe.weight': normal(p, e)}
    for i in range(HF_CONFIG['n_layer']):
        for name, shape in [
            ('ln_1', (e,)),
            ('attn.c_attn', (e, 3 * e)),
            ('attn.c_proj', (e, e)),
            ('ln_2', (e,)),
            ('mlp.c_fc', (e, 4 * e)),
            ('mlp.c_proj', (4 * e, e)),
        ]:
            weight = 1 + normal(*shape) if name.startswith('ln') else normal(*shape)
            tensors[f'h.{i}.{name}.weight'] = weight
            tensors[f'h.{i}.{name}.bias'] = normal(shape[-1])
        tensors[f'h.{i}.attn.bias'] = np.tril(np.ones((1, 1, p, p), np.float32))  # mask buffer
    tensors['ln_f.weight'], tensors['ln_f.bias'] = 1 + normal(e), normal(e)
    return {prefix + name: value for name, value in tensors.items()}


def write_hf_dir(directory, tensors, config=HF_CONFIG):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / 'config.json').write_text(json.dumps(config))
    safetensors.numpy.save_file(tensors, str(directory / 'model.safetensors'))
    return directory


def hf_gpt2_logits(tensors, token_ids):
    """GPT2LMHeadModel's forward in numpy (float64), written from HF's modeling_gpt2."""
    t = {
        name.removeprefix('transformer.'): value.astype(np.float64)
        for name, value in tensors.items()
    }
    heads, eps = HF_CONFIG['n_head'], HF_CONFIG['layer_norm_epsilon']

    def layer_norm(x, name):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * t[name + '.weight'] + t[name + '.bias']

    def conv1d(x, name):
        return x @ t[name + '.weight'] + t[name + '.bias']

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    seq = len(token_ids)
    x = t['wte.weight'][token_ids] + t['wpe.weight'][:seq]
    for i in range(HF_CONFIG['n_layer']):
        h = f'h.{i}.'
        q, k, v = np.split(conv1d(layer_norm(x, h + 'ln_1'), h + 'attn.c_attn'), 3, axis=-1)
        q, k, v = (a.reshape(seq, heads, -1).transpose(1, 0, 2) for a in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(1, 0, 2).reshape(seq, -1)
        x = x + conv1d(context, h + 'attn.c_proj')
        x = x + conv1d(
            gelu_new(conv1d(layer_norm(x, h + 'ln_2'), h + 'mlp.c_fc')), h + 'mlp.c_proj'
        )
    return layer_norm(x, 'ln_f') @ t['wte.weight'].T


def import_into(hf_dir, workdir, *overrides, **position):
    config = config_lib.load(str(ROOT / 'configs/gpt2_124m.py'))
    config.model.compute_dtype = 'float32'
    config.train.update(dict(global_batch=16, micro_batch=2))
    config.mesh.update(dict(data=4, tensor=2))
    for key, value in overrides:
        section, name = key.split('.')
        config[section][name] = value
    convert.import_hf(str(hf_dir), str(workdir), config, **position)
    return workdir


@pytest.fixture(scope='module')
def original(tmp_path_factory):
    """A random HF GPT-2 (names prefixed 'transformer.', as some exports do) and the workdir
    it is imported into under data 4 x tensor 2."""
    root = tmp_path_factory.mktemp('hf')
    tensors = random_hf_tensors(prefix='transformer.')
    hf_dir = write_hf_dir(root / 'original', tensors)
    return tensors, import_into(hf_dir, root / 'imported')


def logits_of(loaded, token_ids):
    model = gpt.merge(loaded.graphdef, loaded.params)
    with jax.set_mesh(loaded.mesh):
        logits = jax.jit(lambda t: model.logits(model(t)))(np.asarray([token_ids] * 8))
    return np.asarray(logits[0])


def test_imported_logits_equal_the_hugging_face_forward(original):
    tensors, workdir = original
    token_ids = np.random.default_rng(1).integers(0, HF_CONFIG['vocab_size'], 32)
    expected = hf_gpt2_logits(tensors, token_ids)
    for data, tensor in ((1, 8), (8, 1)):  # any layout reads the same checkpoint
        logits = logits_of(workdir_lib.load(workdir, data=data, tensor=tensor), token_ids)
        np.testing.assert_allclose(logits[:, : HF_CONFIG['vocab_size']], expected, atol=2e-4)
        assert np.all(logits[:, HF_CONFIG['vocab_size'] :] == -np.inf)  # padding rows


def test_export_then_import_is_bit_exact(original, tmp_path):
    tensors, workdir = original
    convert.export_hf(str(tmp_path / 'exported'), str(workdir), None)
    config, exported = hf_gpt2.read(tmp_path / 'exported')
    for key in ('n_embd', 'n_layer', 'n_head', 'n_positions', 'vocab_size', 'layer_norm_epsilon'):
        assert config[key] == HF_CONFIG[key], key
    assert config['activation_function'] == 'gelu_new'
    originals = {k.removeprefix('transformer.'): v for k, v in tensors.items()}
    originals = {k: v for k, v in originals.items() if not k.endswith('.attn.bias')}
    assert sorted(exported) == sorted(originals)
    for name, value in originals.items():
        assert exported[name].dtype == np.float32 and np.array_equal(exported[name], value), name
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reimported = import_into(tmp_path / 'exported', tmp_path / 'again')
    # The recipe comes from --config (gpt2_124m.py), not from the model: said, not inherited
    # silently.
    assert 'recipe       from --config: lr 0.0006 after 375,000,000 warm-up tokens' in (
        printed.getvalue()
    )
    first = workdir_lib.load(workdir, data=1, tensor=1)
    second = workdir_lib.load(reimported, data=1, tensor=1)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert np.array_equal(a, b)


def test_a_converted_model_has_the_same_eval_loss_under_two_layouts(original):
    _, workdir = original
    rows = [(t, np.ones(32, bool)) for t in np.random.default_rng(2).integers(0, 300, (16, 33))]
    losses = []
    for data, tensor in ((4, 2), (1, 8)):
        scorer = Scorer(workdir_lib.load(workdir, data=data, tensor=tensor), progress=False)
        log_prob, _, count = scorer(rows)
        losses.append(-log_prob.sum() / count.sum())
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_an_import_at_a_megatron_runs_iteration_continues_at_its_step_and_data_position(
    original, tmp_path
):
    tensors, _ = original
    hf_dir = write_hf_dir(tmp_path / 'hf', tensors)
    workdir = import_into(hf_dir, tmp_path / 'at', at_step=5, samples_consumed=80)
    assert [p.name for p in (workdir / 'checkpoints').iterdir()] == ['5']
    state = ocp.StandardCheckpointer().restore(workdir / 'checkpoints/5/state')
    assert int(state['step']) == 5  # the step the training loop goes on from
    meta = json.loads((workdir / 'checkpoints/5/meta/metadata').read_text())
    assert (meta['samples_consumed'], meta['tokens_seen']) == (80, 80 * HF_CONFIG['n_positions'])


def test_non_gpt2_activations_are_refused_with_one_line_and_nothing_written(tmp_path):
    hf_dir = write_hf_dir(
        tmp_path / 'relu', random_hf_tensors(), dict(HF_CONFIG, activation_function='relu')
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / 'launch/convert.py'), '--import_hf', str(hf_dir)]
        + ['--workdir', str(tmp_path / 'w')],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --import_hf {hf_dir}: activation_function 'relu': only "
        "('gelu_new', 'gelu_pytorch_tanh') (tanh GeLU)"
    ]
    assert not (tmp_path / 'w').exists()


def test_an_imported_model_trains_on_from_its_weights(original, tmp_path):
    _, workdir = original
    prefix = str(tmp_path / 'corpus')
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for document in np.random.default_rng(3).integers(0, 300, (40, 100)):
        writer.add(document)
    writer.finish()
    run = tmp_path / 'run'
    shutil.copytree(workdir / 'checkpoints', run / 'checkpoints')
    sources = f'--config.data.sources=((1.0, {prefix!r}),)'
    result = subprocess.run(
        [sys.executable, str(ROOT / 'launch/train.py'), '--config', f'configs/workdir.py:{workdir}']
        + ['--workdir', str(run), sources, '--config.train.steps=1']
        + ['--config.train.log_every=1', '--config.train.eval_batches=1']
        + ['--config.data.tokenizer='],  # the default one's 8192 pieces are not this model's
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads((run / 'metrics.jsonl').read_text().splitlines()[0])
    # The first step's loss is the imported model's loss on the first batch.
    config = json.loads((run / 'config.json').read_text())
    config = config_lib.resolve(ml_collections.ConfigDict(config), jax.device_count())
    batch = open_datasets(config)['train'].read(np.arange(config.train.global_batch))
    scorer = Scorer(workdir_lib.load(workdir), progress=False)
    log_prob, _, count = scorer([(row, np.ones(32, bool)) for row in batch])
    assert first['loss'] == pytest.approx(-log_prob.sum() / count.sum(), abs=1e-5)


def convert_main(capsys, *args):
    """launch/convert.py's main in this process: (exit status, stderr lines)."""
    return support.main_in_process(convert.main, capsys, *args)


@pytest.mark.parametrize(
    'override, given',
    [('--config.model.hidden=128', '64'), ('--config.model.num_layers=4', '2'),
     ('--config.model.norm=rmsnorm', "'layernorm'")],
)  # fmt: skip
def test_an_override_of_the_architecture_that_disagrees_is_refused(
    tmp_path, capsys, override, given
):
    hf_dir = write_hf_dir(tmp_path / 'hf', random_hf_tensors())
    key = override.removeprefix('--config.').partition('=')[0]
    status, err = convert_main(capsys, '--import_hf', hf_dir, '--workdir', tmp_path / 'w', override)
    assert status == 2
    assert err == [
        f'error: {override}: the architecture comes from --import_hf {hf_dir} (config.json '
        f'gives {key} = {given}); drop the override'
    ]
    assert not (tmp_path / 'w').exists()


def test_overrides_that_agree_or_are_not_architecture_are_honoured(tmp_path, capsys):
    hf_dir = write_hf_dir(tmp_path / 'hf', random_hf_tensors())
    workdir = tmp_path / 'w'
    status, err = convert_main(
        capsys, '--import_hf', hf_dir, '--workdir', workdir, '--config.model.hidden=64',
        '--config.model.attention_dropout=0.05', '--config.model.compute_dtype=float32',
        '--config.train.global_batch=16', '--config.train.micro_batch=2',
    )  # fmt: skip
    assert status == 0, err
    model = json.loads((workdir / 'config.json').read_text())['inputs']['model']
    assert (model['hidden'], model['attention_dropout'], model['compute_dtype']) == (
        64, 0.05, 'float32'
    )  # fmt: skip
    assert model['hidden_dropout'] == HF_CONFIG['resid_pdrop']  # not overridden: the HF value
