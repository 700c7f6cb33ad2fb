"""Side values beside the loss (parallel/stage_functions.py): a toy set emitted layer by layer
comes out of every engine as one device's, its differentiable value's gradient included, and a
slot that runs no chunk contributes nothing.

The toy values, each weighted by its layer's index so that a chunk run as another shows:
'penalty' (differentiable) 1e-3 (layer + 1) x the sum of squares of the layer's output,
'amax' (max) (layer + 1) x its largest |entry|, 'layer_tokens' (sum) its rows x seq, and
'by_layer' (sum, shape (layers,)) its sum of |entries| at the layer's index (sums: they add
up alike however the rows are split).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import pipeline
from mtnlg_jax.parallel import schedule as schedule_lib
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.train import step as step_lib

LAYERS = 4
DECLARED = {
    'penalty': side.SideValue('sum', differentiable=True),
    'amax': side.SideValue('max'),
    'layer_tokens': side.SideValue('sum'),
    'by_layer': side.SideValue('sum', shape=(LAYERS,)),
}
RELATIVE = 1e-5  # of each value's and each gradient leaf's largest entry (fp32)


def layer_values(hidden, layer):
    """The toy values of one layer's output hidden (rows, seq, embed)."""
    h = hidden.astype(jnp.float32)
    weight = jnp.asarray(layer, jnp.float32) + 1.0
    return dict(
        penalty=1e-3 * weight * jnp.square(h).sum(),
        amax=weight * jnp.abs(h).max(),
        layer_tokens=jnp.float32(h.shape[0] * h.shape[1]),
        by_layer=jax.nn.one_hot(layer, LAYERS) * jnp.abs(h).sum(),
    )


def with_toy_values(stage_functions):
    """gpt.stage_functions whose apply_blocks runs the chunk a layer at a time and emits
    DECLARED, combined over its layers (a padding slot of an unequal stage: nothing)."""

    def build(graphdef, param_axes=None):
        fns = stage_functions(graphdef, param_axes)

        def apply_blocks(
            chunk, hidden, batch, first_layer, remat, used=None, taps=None, unroll=False
        ):
            def one_layer(carry, slot_and_layer):
                hidden, values = carry
                i, layer, *layer_taps = slot_and_layer  # taps: zbh1's (parallel/taps.py)
                layer, *layer_taps = jax.tree.map(lambda a: a[None], [layer, *layer_taps])
                left = None if used is None else used - i
                hidden, _ = fns.apply_blocks(
                    layer, hidden, batch, first_layer + i, remat, left, *layer_taps
                )
                ran = True if used is None else i < used
                emitted = side.where_ran(DECLARED, ran, layer_values(hidden, first_layer + i))
                return (hidden, side.combine(DECLARED, values, emitted)), None

            slots = jnp.arange(jax.tree.leaves(chunk)[0].shape[0])
            init = (hidden, side.identities(DECLARED))
            more = () if taps is None else (taps,)
            return jax.lax.scan(one_layer, init, (slots, chunk, *more), unroll=unroll)[0]

        return dataclasses.replace(fns, apply_blocks=apply_blocks, values=DECLARED)

    return build


@pytest.fixture(scope='module')
def one_device():
    """(loss, grads, values) of the Sequential engine on one device with the toy values, and
    its gradients without them; the toy values stay on for the module's other tests."""
    batch = support.random_batches(1)[0]
    config = support.small_config(num_layers=LAYERS)
    _, _, plain = support.gradients(config, batch, step=5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpt, 'stage_functions', with_toy_values(gpt.stage_functions))
        params, loss, grads, values = support.gradients_and_values(config, batch, step=5)
        yield dict(batch=batch, params=params, loss=loss, grads=grads, values=values, plain=plain)


def assert_values_close(values, expected):
    assert sorted(values) == sorted(DECLARED)
    support.assert_within_leaf_scale(values, expected, RELATIVE)


def test_the_one_device_values_are_the_toys_and_the_penalty_moves_the_gradients(one_device):
    """The values are what the toy says (every layer's rows x seq of every micro-batch counted
    once, each layer's slot of by_layer filled), and the penalty's gradient is there: the
    gradients differ from those without it far beyond the tolerance."""
    values = one_device['values']
    assert values['layer_tokens'] == LAYERS * support.GLOBAL_BATCH * support.SEQ_LEN
    assert (values['by_layer'] != 0).all() and values['amax'] > 0 and values['penalty'] > 0
    change = max(
        np.abs(a - b).max() / np.abs(b).max()
        for a, b in zip(jax.tree.leaves(one_device['grads']), jax.tree.leaves(one_device['plain']))
    )
    assert change > 100 * RELATIVE


LAYOUTS = {
    '1f1b-d2s2t2-fused': lambda: fused(support.small_config(2, 2, 2, 4, num_layers=LAYERS)),
    'interleaved-s2t2v2-steady-fused': lambda: fused(
        steady(support.small_config(1, 2, 2, 4, 2, 'interleaved', num_layers=LAYERS))
    ),
    'interleaved-s2t2v2-fused': lambda: fused(
        support.small_config(1, 2, 2, 4, 2, 'interleaved', num_layers=LAYERS)
    ),
    'gpipe-d2s2v2': lambda: support.small_config(2, 2, 1, 4, 2, 'gpipe', num_layers=LAYERS),
    'zbh1-s4t2': lambda: support.small_config(1, 4, 2, 8, 1, 'zbh1', num_layers=LAYERS),
    'zbv-s2t2': lambda: support.small_config(1, 2, 2, 4, 2, 'zbv', num_layers=LAYERS),
}


def steady(config):
    """config under pipeline.steady_tick (the tick as one switch over its slot pairs)."""
    config.pipeline.steady_tick = True
    return config


def fused(config):
    """config under pipeline.fused_accumulation (the kernels' gradients contracted in their
    accumulators' add: in B's own branch with one chunk a stage, in each chunk's own
    conditional with more, by slot; in each chunk's add under the steady tick)."""
    config.pipeline.fused_accumulation = True
    return config


@pytest.mark.parametrize('layout', LAYOUTS)
def test_every_engine_carries_the_values_and_their_gradient_as_one_device(one_device, layout):
    """The train step's initial parameters (bit for bit), loss, gradients (per leaf, relative
    to its scale) and values (combined over layers, chunks, micro-batches, stages and
    replicas) equal one device's. The 1f1b and zbh1 layouts are test_pipeline.py's
    d2s2t2v1m4-1f1b and d1s4t2v1m8-zbh1: these cases hold those engines to one device there;
    the 1f1b and interleaved ones here run pipeline.fused_accumulation (the interleaved one
    by slot, each chunk's backward a conditional of its own, and under the steady tick);
    zbv's V (its hand-offs both ways, the loss on stage 0) is held to it here by slot (with
    Llama's block over stages of unequal depth and the steady tick: test_unequal_stages.py)."""
    config = LAYOUTS[layout]()
    params, loss, grads, values = support.gradients_and_values(config, one_device['batch'], step=5)
    support.assert_trees_close(params, one_device['params'], atol=0.0)
    np.testing.assert_allclose(loss, one_device['loss'], rtol=1e-6)
    support.assert_gradients_close(grads, one_device['grads'], relative=RELATIVE)
    assert_values_close(values, one_device['values'])


def test_the_train_steps_metrics_hold_the_values_under_their_names(one_device):
    """The Sequential engine over data 2 x tensor 2, through the train step: its metrics add
    the values to the loss, the differentiable one per token, as one device's."""
    config = support.small_config(2, 1, 2, num_layers=LAYERS)
    mesh, setup = support.layout(config)
    batch = one_device['batch'].astype(np.int32)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 2), mesh)
        step = step_lib.make_train_step(config, setup)
        _, metrics = step(state, tokens, rows, jnp.float32(batch[:, 1:].size))
    assert set(metrics) == {'loss', 'grad_norm', 'lr', 'skipped', *DECLARED}
    np.testing.assert_allclose(metrics['loss'], one_device['loss'], rtol=1e-6)
    assert_values_close({name: metrics[name] for name in DECLARED}, one_device['values'])


def test_idle_slots_filled_with_nan_reach_no_value_and_eval_carries_them(one_device):
    """The table engine (interleaved, with idle slots) with its empty slots NaN: the values,
    with gradients and without (evaluation), are the clean run's and one device's; the loss
    and gradients are finite and the clean run's, bit for bit (test_pipeline.py's NaN check
    of the interleaved table, carried by this compile); with gradients under the steady tick
    too, whose idle slots are branches of their own."""
    config = support.small_config(stage=2, repeats=2, micro_steps=4, num_layers=LAYERS)
    mesh, setup = support.layout(config)
    tokens = jnp.asarray(one_device['batch'].reshape(4, 4, -1), jnp.int32)
    table = schedule_lib.build(2, 2, 4)
    assert (table.fwd_micro == schedule_lib.IDLE).any()
    stage_fns = gpt.stage_functions(setup.graphdef)
    assert stage_fns.values == DECLARED  # the toy's, patched in by the fixture

    def runs(with_grads, steady):
        """(loss, _, gradients, values) of the clean run and of the poisoned one."""
        run = jax.jit(
            lambda params, fill: pipeline.run_schedule(
                stage_fns, params, tokens, None, table, with_grads, fill, steady_tick=steady
            )
        )
        with jax.set_mesh(mesh):
            params = state_lib.init_state(config, setup)['params']
            return run(params, jnp.float32(0.0)), run(params, jnp.float32(jnp.nan))

    expected = dict(one_device['values'])
    expected['penalty'] = expected['penalty'] * tokens[..., 1:].size  # a sum, not per token
    for with_grads, steady in ((True, False), (True, True), (False, False)):
        clean, poisoned = runs(with_grads, steady)
        support.assert_trees_close(poisoned[3], clean[3], atol=0.0)
        assert_values_close(poisoned[3], expected)
        if with_grads:
            assert np.isfinite(poisoned[0])
            assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(poisoned[2]))
            np.testing.assert_array_equal(poisoned[0], clean[0])
            support.assert_trees_close(poisoned[2], clean[2], atol=0.0)
