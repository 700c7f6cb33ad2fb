"""Buffers (model/buffers.py): state outside the gradient, as a toy block declares it.

The toy block holds a buffer of two numbers drawn per layer, adds their mean to its output (so
a block that read another layer's buffer would change the loss) and moves them after each step
by a rule that reads the step and a side value of the step (test_side_values.py's toy values:
'layer_tokens', the rows x seq every layer saw, over the whole batch). The invariants: the
buffers are the model's (initialised with it, read in the forward by their own layer, never
given to the optimizer), the step updates them in layer order whatever the layout, a skipped
step keeps them, and a checkpoint carries them to another layout, which continues as the
uninterrupted run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.model import block as block_lib
from mtnlg_jax.model import buffers as buffers_lib
from mtnlg_jax.model import gpt
from mtnlg_jax.train import resume
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.train import step as step_lib
from test_side_values import with_toy_values
from support import (
    GLOBAL_BATCH,
    SEQ_LEN,
    assert_trees_close,
    in_layer_order,
    layout,
    random_batches,
    small_config,
)


LAYER_TOKENS = 4 * GLOBAL_BATCH * SEQ_LEN  # 'layer_tokens' of a step: 4 layers, every row


@buffers_lib.update_rule('toy')
def _toy_rule(value, values, step):
    """Halve, then add the step and the tokens the layers saw: what a step did is visible in
    every later value."""
    return 0.5 * value + step.astype(jnp.float32) + values['layer_tokens'] / LAYER_TOKENS


def _moved(value, steps):
    for step in range(steps):
        value = 0.5 * value + step + 1.0
    return value


class ToyBlock(block_lib.Block):
    def __init__(self, cfg, rngs, *args, **kwargs):
        super().__init__(cfg, rngs, *args, **kwargs)
        drawn = jax.random.uniform(rngs.params(), (2,), jnp.float32)
        self.toy = buffers_lib.buffer(drawn, (None,), rule='toy')

    def __call__(self, x, *args, **kwargs):
        # not a constant along `embed`, which the next norm would take away
        shift = 0.1 * self.toy[...].mean() * jnp.linspace(-1.0, 1.0, x.shape[-1])
        x, values = super().__call__(x, *args, **kwargs)
        return x + shift.astype(x.dtype), values


@pytest.fixture
def toy_blocks(monkeypatch):
    """Every GPT built in the test has ToyBlocks, and its block stack emits the toy values."""
    monkeypatch.setattr(gpt, 'Block', ToyBlock)
    monkeypatch.setattr(gpt, 'stage_functions', with_toy_values(gpt.stage_functions))


LAYOUTS = {  # 4 layers; the pipelined ones store the blocks stage-major
    'one device': dict(),
    'interleaved': dict(data=2, stage=2, tensor=2, repeats=2, micro_steps=4),
    'unequal stages': dict(stage=2, tensor=2, micro_steps=4),
}


def _config(name, steps=3):
    config = small_config(num_layers=4, **LAYOUTS[name])
    if name == 'unequal stages':
        config.pipeline.first_stage_layers = 1
    config.train.steps = steps
    return config


_STEPS = {}  # id(config) -> (config, mesh, setup, its train step): one compile a config


def _run(config, batches, state=None, first=0):
    """(losses, final state) of train steps over `batches` from `state` (None: the initial
    one) at step `first`. A config run again (the halves of a resumed run; not changed in
    between) reuses its compiled step."""
    if id(config) not in _STEPS:  # the config held in the value: its id is not reused
        mesh, setup = layout(config)
        _STEPS[id(config)] = config, mesh, setup, step_lib.make_train_step(config, setup)
    _, mesh, setup, train_step = _STEPS[id(config)]
    losses = []
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup) if state is None else state
        for i, batch in enumerate(batches, start=first):
            tokens, rows = batch_lib.place_batch(
                *batch_lib.to_micro_steps(batch.astype(np.int32), config.train.micro_steps), mesh
            )
            tokens_seen = jnp.float32((i + 1) * GLOBAL_BATCH * SEQ_LEN)
            state, metrics = train_step(state, tokens, rows, tokens_seen)
            losses.append(float(metrics['loss']))
    return np.array(losses), state


def test_buffers_are_the_models_own_state_and_not_parameters(toy_blocks):
    config = _config('interleaved')
    _, setup = layout(config)
    state = setup.abstract_state
    assert jax.tree.map(lambda a: a.shape, state['buffers']) == {'blocks': {'toy': (4, 2)}}
    assert 'toy' not in state['params']['blocks']
    assert setup.buffer_rules == {'blocks': {'toy': 'toy'}}
    # the stored form splits the layers over 'stage' like the blocks' parameters
    spec = setup.state_shardings['buffers']['blocks']['toy'].spec
    assert spec[0] == 'stage'
    # the optimizer holds nothing of them
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)}
    assert not any('toy' in n for n in names if n.startswith("['opt_state']"))


def _initial_buffers(config):
    mesh, setup = layout(config)
    with jax.set_mesh(mesh):
        return jax.device_get(state_lib.init_state(config, setup)['buffers'])


def test_the_forward_reads_each_layers_own_buffer(toy_blocks):
    """The loss moves with one layer's buffer: the block reads it (a block reading another
    layer's would make the pipelined losses above differ)."""
    config = _config('one device')
    mesh, setup = layout(config)
    batch = random_batches(1)[0].astype(np.int32)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 2), mesh)
        eval_step = step_lib.make_eval_step(config, setup)
        base = eval_step(state['params'], tokens, state['buffers'])
        shifted = jax.tree.map(lambda b: b.at[2].add(5.0), state['buffers'])
        moved = eval_step(state['params'], tokens, shifted)
    assert abs(float(moved[0]) - float(base[0])) > 1e-5 * abs(float(base[0]))  # fp32: 1e-7


def test_a_skipped_step_keeps_the_buffers(toy_blocks):
    config = _config('one device')
    mesh, setup = layout(config)
    batch = random_batches(1)[0].astype(np.int32)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        before = jax.device_get(state['buffers'])
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 2), mesh)
        poisoned = step_lib.make_train_step(config, setup, inject='nan')
        state, metrics = poisoned(state, tokens, rows, jnp.float32(512))
    assert int(metrics['skipped']) == 1
    assert_trees_close(jax.device_get(state['buffers']), before, atol=0)


def test_buffers_follow_their_rule_in_layer_order_under_any_layout_and_through_a_checkpoint(
    toy_blocks, tmp_path
):
    """One device for 4 steps; the same from an interleaved pipeline's 2 steps, saved, restored
    onto stages of unequal depth for the other 2: the same losses and buffers at both points,
    and the buffers what the rule makes of each layer's own initial draw."""
    batches = random_batches(4)
    one = _config('one device')
    one_losses, halfway = _run(one, batches[:2])
    halfway_buffers = jax.device_get(halfway['buffers'])  # the next steps donate the state
    more_losses, uninterrupted = _run(one, batches[2:], halfway, first=2)

    first = _config('interleaved')
    losses, state = _run(first, batches[:2])
    np.testing.assert_allclose(losses, one_losses, rtol=2e-5)
    got = in_layer_order(first, jax.device_get(state['buffers']))
    assert_trees_close(got, halfway_buffers, atol=1e-6)
    mesh, setup = layout(first)
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    with jax.set_mesh(mesh):
        saved = state_lib.pipeline_order(first, setup, to='layer')(state)
        checkpoints.save(2, saved, resume.checkpoint_meta(first, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()

    second = _config('unequal stages')
    mesh, setup = layout(second)
    with jax.set_mesh(mesh):
        checkpoints = checkpoint_lib.Checkpoints(tmp_path)
        position = resume.restore_or_init(second, setup, checkpoints, log=lambda _: None)
        checkpoints.close()
    losses, state = _run(second, batches[2:], position.state, first=2)
    np.testing.assert_allclose(losses, more_losses, rtol=2e-5)
    got = in_layer_order(second, jax.device_get(state['buffers']))
    assert_trees_close(got, jax.device_get(uninterrupted['buffers']), atol=1e-6)

    moved = _moved(_initial_buffers(one)['blocks']['toy'], 4)
    np.testing.assert_allclose(got['blocks']['toy'], moved, rtol=1e-6)


def test_init_from_another_run_takes_its_buffers_with_its_parameters(toy_blocks, tmp_path):
    other = _config('one device')
    other.train.seed = 11
    mesh, setup = layout(other)
    checkpoints = checkpoint_lib.Checkpoints(tmp_path / 'other')
    with jax.set_mesh(mesh):
        saved = state_lib.init_state(other, setup)
        checkpoints.save(3, saved, resume.checkpoint_meta(other, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()

    config = _config('unequal stages')
    config.checkpoint.init_from = str(tmp_path / 'other')
    mesh, setup = layout(config)
    lines = []
    with jax.set_mesh(mesh):
        checkpoints = checkpoint_lib.Checkpoints(tmp_path / 'new')
        position = resume.restore_or_init(config, setup, checkpoints, log=lines.append)
        checkpoints.close()
    got = in_layer_order(config, jax.device_get(position.state['buffers']))
    assert_trees_close(got, jax.device_get(saved['buffers']), atol=0)
    assert 'initialised  parameters and buffers from step 3' in lines[0]


def test_a_workdir_loads_for_evaluation_with_its_buffers(toy_blocks, tmp_path):
    """eval/workdir.load reads the buffers beside the parameters (not the optimizer state), on
    the inference mesh: the loaded model's loss is the train step's eval loss."""
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.run.rundir import RunDir

    config = _config('unequal stages')
    mesh, setup = layout(config)
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    batch = random_batches(1)[0].astype(np.int32)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        state['buffers'] = jax.tree.map(lambda b: b + 1.0, state['buffers'])  # not the init's
        saved = state_lib.pipeline_order(config, setup, to='layer')(state)
        checkpoints.save(3, saved, resume.checkpoint_meta(config, resume.fresh_counters()))
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 4), mesh)
        loss, count = step_lib.make_eval_step(config, setup)(
            state['params'], tokens, state['buffers']
        )
    checkpoints.wait()
    checkpoints.close()
    RunDir(tmp_path).write_config(config.to_dict())

    loaded = workdir_lib.load(tmp_path, data=2, tensor=2)
    toy = jax.device_get(loaded.params['blocks']['toy'])
    np.testing.assert_array_equal(toy, jax.device_get(saved['buffers']['blocks']['toy']))
    with jax.set_mesh(loaded.mesh):
        total, tokens_counted = jax.jit(
            lambda p, b: gpt.loss_sum(gpt.merge(loaded.graphdef, p), b)
        )(loaded.params, batch)
    assert float(tokens_counted) == float(count)
    np.testing.assert_allclose(float(total), float(loss), rtol=1e-5)
