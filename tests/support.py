"""Helpers the tests share: a small model under any layout, and runs of a few steps."""

import atexit
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from mtnlg_jax import config as config_lib
from mtnlg_jax.parallel import stage_order
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.train import step as step_lib

GLOBAL_BATCH = 16
SEQ_LEN = 32
VOCAB = 1000  # padded to 1024 for tensor 1, 2, 4 and 8 alike


# Llama's block on small_config's shapes: rope with llama3 scaling (an original context of 16
# of the 32 positions, so every regime of the scaling is used), RMSNorm, SwiGLU, 8 query heads
# over 4 key/value heads (tensor 2 and 4 divide them), untied output, no biases.
LLAMA_BLOCK = dict(
    position='rope',
    rope_theta=500000.0,
    rope_scaling=dict(
        type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=16
    ),
    norm='rmsnorm',
    mlp='swiglu',
    kv_heads=4,
    tie_embeddings=False,
    bias=False,
)


def small_config(
    data=1,
    stage=1,
    tensor=1,
    micro_steps=2,
    repeats=1,
    schedule='1f1b',
    expert=1,
    context=1,
    first_stage_layers=0,
    **model_overrides,
):
    """A 2-layer GPT (heads divisible by 8) that runs in seconds, fp32, no dropout; expert:
    mesh.expert (an MoE model's), more replicas of the batch beside data's; context:
    mesh.context (each sequence in 2 x context chunks); first_stage_layers: the pipeline's
    (0: stages of equal depth)."""
    config = config_lib.defaults()
    config.mesh.update(dict(data=data, stage=stage, tensor=tensor, expert=expert, context=context))
    config.pipeline.update(
        dict(repeats=repeats, schedule=schedule, first_stage_layers=first_stage_layers)
    )
    config.model.update(
        dict(
            num_layers=2,
            hidden=64,
            heads=8,
            seq_len=SEQ_LEN,
            vocab_size=VOCAB,
            compute_dtype='float32',
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
    )
    config.model.update(model_overrides)
    config.train.update(
        dict(
            global_batch=GLOBAL_BATCH,
            micro_batch=GLOBAL_BATCH // (data * expert * micro_steps),
            seed=3,
        )
    )
    config.optimizer.update(dict(lr=3e-3, min_lr=3e-4, warmup_tokens=1024))
    config.train.steps = 10
    return config_lib.resolve(config, data * stage * expert * context * tensor)


# Small layouts the planner is checked against, compiled by XLA:CPU (test_plan_compiled.py)
# and XLA:GPU (test_gpu_compile.py). Hidden 256 keeps the state, which the plan counts
# exactly, the larger part of memory; vocab 1500 pads to 1536, a size no other dimension has.
PLAN_LAYOUTS = {
    'tensor': dict(data=2, tensor=4),
    'pipelined': dict(data=2, stage=2, tensor=2, repeats=2, num_layers=4, micro_steps=4),
    'data_bf16': dict(data=8, compute_dtype='bfloat16'),
}


def plan_config(name, remat='none'):
    return small_config(**PLAN_LAYOUTS[name], remat=remat, hidden=256, vocab_size=1500)


def layout(config):
    """Mesh (on the first devices) and train setup of a resolved config."""
    mesh = mesh_from_config(config)
    return mesh, state_lib.make_setup(config, mesh)


def random_batches(count, seed=0):
    """Learnable global batches (count, GLOBAL_BATCH, SEQ_LEN + 1): chains of a fixed random
    bigram map from random starts, so a few steps visibly lower the loss."""
    rng = np.random.default_rng(seed)
    successor = np.random.default_rng(1234).permutation(VOCAB)
    tokens = np.empty((count, GLOBAL_BATCH, SEQ_LEN + 1), np.int64)
    tokens[..., 0] = rng.integers(0, VOCAB, (count, GLOBAL_BATCH))
    for t in range(1, SEQ_LEN + 1):
        tokens[..., t] = successor[tokens[..., t - 1]]
    return tokens


def gradients(config, batch, step=0):
    """(initial params, loss, grads) of one global batch, all on the host."""
    return gradients_and_values(config, batch, step)[:3]


def gradients_and_values(config, batch, step=0, buffers_after=False):
    """(initial params, loss, grads, side values) of one global batch, all on the host
    (step.gradients_and_values); buffers_after: and a fifth, the buffers the train step
    keeps after this batch (step.buffers_after on these side values, in the same compile),
    in layer order."""
    mesh, setup = layout(config)

    def grad_fn(params, tokens, rows, buffers):
        loss, grads, values = step_lib.gradients_and_values(
            config, setup, params, tokens, rows, jnp.int32(step), buffers
        )
        if not buffers_after:
            return loss, grads, values, None
        return loss, grads, values, step_lib.buffers_after(setup, buffers, values, jnp.int32(step))

    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, rows = batch_lib.place_batch(
            *batch_lib.to_micro_steps(batch.astype(np.int32), config.train.micro_steps), mesh
        )
        out = jax.jit(grad_fn)(state['params'], tokens, rows, state.get('buffers'))
        params, (loss, grads, values, after) = jax.device_get((state['params'], out))
    got = in_layer_order(config, params), loss, in_layer_order(config, grads), values
    return (*got, in_layer_order(config, after)) if buffers_after else got


def in_layer_order(config, tree):
    """Block parameters (or gradients) of a pipelined layout back in plain layer order."""
    return stage_order.to_layer_order(tree, stage_order.of_config(config))


def train_losses(config, batches, metrics=None):
    """Losses of len(batches) train steps from the initial state, and the final state;
    metrics: a list each step's metrics are appended to (on the host), if given."""
    mesh, setup = layout(config)
    train_step = step_lib.make_train_step(config, setup)
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    losses = []
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        for i, batch in enumerate(batches):
            tokens, rows = batch_lib.place_batch(
                *batch_lib.to_micro_steps(batch.astype(np.int32), config.train.micro_steps), mesh
            )
            state, step_metrics = train_step(
                state, tokens, rows, jnp.float32((i + 1) * tokens_per_step)
            )
            losses.append(float(step_metrics['loss']))
            if metrics is not None:
                metrics.append(jax.device_get(step_metrics))
    return np.array(losses), state


def assert_trees_close(actual, expected, atol, rtol=0.0):
    paths_actual = jax.tree_util.tree_leaves_with_path(actual)
    paths_expected = jax.tree_util.tree_leaves_with_path(expected)
    assert [p for p, _ in paths_actual] == [p for p, _ in paths_expected]
    for (path, a), (_, e) in zip(paths_actual, paths_expected):
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, err_msg=jax.tree_util.keystr(path))


def assert_within_leaf_scale(actual, expected, relative, scale=None, what='value'):
    """Per leaf: max |actual - expected| within `relative` x the leaf's largest |scale| entry
    (scale: `expected` itself unless given). Each leaf is held to its own size, so a leaf of
    small values is not let off by an absolute bound made for large ones, and float noise in
    a large leaf does not fail a bound made for small ones."""
    scale = expected if scale is None else scale
    paths = jax.tree_util.tree_leaves_with_path(actual)
    assert [p for p, _ in paths] == [p for p, _ in jax.tree_util.tree_leaves_with_path(expected)]
    for (path, a), e, s in zip(paths, jax.tree.leaves(expected), jax.tree.leaves(scale)):
        error, size = np.abs(np.asarray(a) - e).max(), np.abs(np.asarray(s)).max()
        assert error <= relative * size, (
            f'{jax.tree_util.keystr(path)}: max error {error:.3g} above {relative:g} x the '
            f"leaf's max |{what}| {size:.3g}"
        )


def assert_gradients_close(actual, expected, atol=1e-5, relative=1e-5):
    """Per leaf: max |actual - expected| within `relative` x the leaf's largest |expected|
    (a leaf of small gradients is held to its own scale) and within `atol` everywhere."""
    assert_trees_close(actual, expected, atol=atol)
    assert_within_leaf_scale(actual, expected, relative, what='gradient')


def assert_dropout_does_not_depend_on_the_layout(layout, dropout, **model):
    """With `dropout` (model keys), `layout` (small_config keys) starts from one device's
    parameters (bit for bit) and computes its loss and gradients of one step, and dropout
    moves the gradients far beyond that tolerance (so the masks are drawn, and drawn alike)."""
    batch = random_batches(1)[0]
    params_one, loss_one, grads_one, grads_no_dropout = _one_device_with_and_without(dropout, model)
    config = small_config(**layout, **model, **dropout)
    params_many, loss_many, grads_many = gradients(config, batch, step=5)
    assert_trees_close(params_many, params_one, atol=0.0)
    change = max(
        np.abs(a - b).max()
        for a, b in zip(jax.tree.leaves(grads_one), jax.tree.leaves(grads_no_dropout))
    )
    assert change > 1e-3, 'dropout should change the gradients far beyond the tolerance'
    np.testing.assert_allclose(loss_many, loss_one, rtol=1e-6)
    assert_gradients_close(grads_many, grads_one)


_ONE_DEVICE = {}  # the one-device side of the check above, for each (dropout, model)


def _one_device_with_and_without(dropout, model):
    """(initial parameters, loss, gradients) of one device with `dropout` and its gradients
    without: the same for every layout a test checks, so computed once a process."""
    key = repr((sorted(dropout.items()), sorted(model.items())))
    if key not in _ONE_DEVICE:
        batch = random_batches(1)[0]
        params, loss, grads = gradients(
            small_config(data=1, micro_steps=1, **model, **dropout), batch, step=5
        )
        _, _, no_dropout = gradients(small_config(data=1, **model), batch, step=5)
        _ONE_DEVICE[key] = params, loss, grads, no_dropout
    return _ONE_DEVICE[key]


def assert_updates_close(actual, expected, initial, relative=1e-2):
    """Parameters after the same optimizer steps from the same `initial` ones: per leaf, max
    |actual - expected| within `relative` x the leaf's largest update |expected - initial|.

    Not an absolute bound: Adam divides each gradient by its own running scale, so float-order
    noise in a gradient near zero (another summation order, another CPU's kernels) moves that
    element by a visible fraction of its step (1 element of 8,192 was 1.3e-5 apart after 5
    steps on one machine). Measured against its leaf's update that noise is under 1e-3, while
    a real difference (a micro-batch lost or weighted wrong) is of the update's own size."""
    update = jax.tree.map(lambda e, i: np.asarray(e) - np.asarray(i), expected, initial)
    assert_within_leaf_scale(actual, expected, relative, scale=update, what='update')


def initial_params(config):
    """The parameters a run of `config` starts from, on the host, in plain layer order."""
    mesh, setup = layout(config)
    with jax.set_mesh(mesh):
        params = jax.device_get(state_lib.init_state(config, setup)['params'])
    return in_layer_order(config, params)


ROOT = pathlib.Path(__file__).resolve().parents[1]
# Command-line overrides that shrink configs/tiny.py to a model a test trains in seconds, on
# the quickest layout to compile (no pipeline): data 4 x stage 1 x tensor 2.
SMALL_MODEL = [
    '--config.mesh.data=4',
    '--config.mesh.stage=1',
    '--config.mesh.tensor=2',
    '--config.pipeline.repeats=1',
    '--config.model.remat=none',
    '--config.model.num_layers=4',
    '--config.model.hidden=64',
    '--config.model.heads=8',
    '--config.model.seq_len=32',
    '--config.model.vocab_size=300',
    '--config.data.tokenizer=',  # none: tiny's own (8192 pieces) does not fit
    '--config.train.global_batch=16',
    '--config.train.micro_batch=2',
    '--config.train.rampup.start=0',
    '--config.data.tokenizer=',  # token ids < 300 of no tokenizer (none is checked then)
]


# The process tests start launch/train.py dozens of times with the same few small models: an
# XLA compilation cache shared by this session's runs lets every run after the first skip
# most of its compile time (about 5x faster on a 2-core CPU).
_COMPILATION_CACHE = tempfile.mkdtemp(prefix='mtnlg_jax_test_xla_cache_')
atexit.register(shutil.rmtree, _COMPILATION_CACHE, True)
TRAIN_ENV = dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=_COMPILATION_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
)


def train_args(workdir, *overrides, data=None):
    """The command line of launch/train.py with configs/tiny.py and `overrides`; data: the
    prefix of one indexed dataset (conftest's token_data)."""
    args = [
        sys.executable,
        str(ROOT / 'launch/train.py'),
        '--config',
        str(ROOT / 'configs/tiny.py'),
    ]
    args += ['--workdir', str(workdir), *overrides]
    if data is not None:
        args.append(f'--config.data.sources=((1.0, {str(data)!r}),)')
    return args


def run_train(workdir, *overrides, data=None):
    """launch/train.py as a user runs it, in a subprocess."""
    args = train_args(workdir, *overrides, data=data)
    return subprocess.run(
        args, capture_output=True, text=True, cwd=ROOT, env=TRAIN_ENV, timeout=300
    )


def run_launch(script, *args, env=None):
    """launch/SCRIPT with `args` as a user runs it, in a subprocess."""
    return subprocess.run(
        [sys.executable, str(ROOT / 'launch' / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def _status(main, args):
    """main(argv)'s exit status: what it returns or exits with, 0 for None."""
    try:
        return main([str(a) for a in args]) or 0
    except SystemExit as e:
        return e.code


def main_in_process(main, capsys, *args):
    """A launch tool's `main(argv)` run in this process: (exit status, stderr lines)."""
    status = _status(main, args)
    return status, capsys.readouterr().err.strip().splitlines()


def launch_module(script):
    """launch/SCRIPT.py as a module (its main(argv) runs in this process: no second JAX
    start-up, which costs a bad-input test a subprocess's 2 s)."""
    spec = importlib.util.spec_from_file_location(script, ROOT / 'launch' / f'{script}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_in_process(script, capsys, monkeypatch, *args):
    """launch/SCRIPT.py's main(args) in this process: (exit status, stdout, stderr lines).
    The XLA flags a tool sets before JAX starts are put back afterwards."""
    monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
    status = _status(launch_module(script).main, args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err.strip().splitlines()


def bench_with_stubbed_compiles(bench, monkeypatch, compile_stub, *args):
    """bench/BENCH.py's main() with `args`, each launch/plan.py subprocess replaced by
    compile_stub(command) and the XLA:GPU compiler taken as installed: its exit status."""
    import plan_runs  # noqa: PLC0415 (bench/ on the path: the bench tests put it there)

    monkeypatch.setattr(plan_runs.subprocess, 'run', lambda command, **_: compile_stub(command))
    monkeypatch.setattr(bench.gpu_compile, 'missing', lambda: None)
    monkeypatch.setattr(sys, 'argv', [f'bench/{bench.__name__}.py', *map(str, args)])
    return _status(lambda _: bench.main(), ())
