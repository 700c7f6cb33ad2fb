"""The circular pipeline against the plain sequential model on one device (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import pipeline
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.train import step as step_lib

LAYERS = 8
# (stages p, repeats v, micro-batches m) on data 1 x tensor 1, and the full 3D layout.
SCHEDULES = [
    dict(stage=2, repeats=1, micro_steps=2),
    dict(stage=2, repeats=2, micro_steps=4),
    dict(stage=4, repeats=1, micro_steps=4),
    dict(stage=4, repeats=2, micro_steps=8),
    dict(stage=2, repeats=1, micro_steps=8),
    dict(stage=4, repeats=1, micro_steps=2),  # m < p without repeats; head not split
    dict(data=2, stage=2, tensor=2, repeats=2, micro_steps=4),
]
TRAJECTORY_SCHEDULES = [s for s in SCHEDULES if s.get('micro_steps', 2) >= s['stage']]


def _name(schedule):
    return 'x'.join(f'{k}{v}' for k, v in schedule.items())


@pytest.fixture(scope='module')
def one_device():
    config = support.small_config(num_layers=LAYERS)
    params, loss, grads = support.gradients(config, support.random_batches(1)[0])
    losses, _ = support.train_losses(config, support.random_batches(10, seed=1))
    return dict(params=params, loss=loss, grads=grads, losses=losses)


@pytest.mark.parametrize('schedule', SCHEDULES, ids=_name)
def test_pipelined_loss_and_gradients_match_one_device(one_device, schedule):
    config = support.small_config(num_layers=LAYERS, **schedule)
    params, loss, grads = support.gradients(config, support.random_batches(1)[0])
    support.assert_trees_close(params, one_device['params'], atol=0.0)
    np.testing.assert_allclose(loss, one_device['loss'], rtol=1e-6)
    support.assert_trees_close(grads, one_device['grads'], atol=1e-5)


@pytest.mark.parametrize('schedule', TRAJECTORY_SCHEDULES, ids=_name)
def test_pipelined_ten_step_losses_match_one_device(one_device, schedule):
    config = support.small_config(num_layers=LAYERS, **schedule)
    losses, _ = support.train_losses(config, support.random_batches(10, seed=1))
    np.testing.assert_allclose(losses, one_device['losses'], atol=1e-4)


def test_each_stage_holds_only_its_own_blocks_and_their_optimizer_state():
    config = support.small_config(data=2, stage=2, tensor=2, repeats=2, num_layers=LAYERS)
    mesh, setup = support.layout(config)
    state = state_lib.init_state(config, setup)
    kernel = state['params']['blocks']['mlp']['in_kernel']  # (layers 8, embed 64, mlp 256)
    moment = state['opt_state'][1].mu['blocks']['mlp']['in_kernel']
    for array in (kernel, moment):
        assert array.sharding.spec[0] == 'stage'
        # 8 layers over 2 stages; embed split by ZeRO over data; mlp over tensor.
        assert array.addressable_shards[0].data.shape == (4, 32, 128)
    first_stage_layers = pipeline.schedule_order(LAYERS, stages=2, repeats=2)[:4]
    assert list(first_stage_layers) == [0, 1, 4, 5]  # chunks 0 and 2 of 2 layers each


def test_bubble_slots_filled_with_nan_never_reach_loss_or_gradients():
    config = support.small_config(stage=2, repeats=2, micro_steps=4, num_layers=4)
    mesh, setup = support.layout(config)
    tokens = jnp.asarray(support.random_batches(1)[0].reshape(4, 4, -1), jnp.int32)

    def loss_and_grads(bubble_fill):
        def loss(params):
            model = gpt.merge(setup.graphdef, params)
            x = model.embed(tokens[..., :-1])
            graphdef, stacked = nnx.split(model.blocks)
            h = pipeline.run_pipeline(
                graphdef,
                stacked,
                x,
                None,
                stages=2,
                repeats=2,
                remat='full',
                bubble_fill=bubble_fill,
            )
            logits = model.logits(model.final_norm(h.reshape(-1, *h.shape[2:])))
            return gpt.cross_entropy(logits, tokens[..., 1:].reshape(16, -1)).mean()

        return jax.jit(jax.value_and_grad(loss))(state['params'])

    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        clean = loss_and_grads(0.0)
        poisoned = loss_and_grads(float('nan'))
    assert np.isfinite(poisoned[0])
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(poisoned[1]))
    np.testing.assert_array_equal(poisoned[0], clean[0])
    support.assert_trees_close(poisoned[1], clean[1], atol=0.0)


@pytest.mark.parametrize('stages,repeats,micro', [(2, 1, 2), (2, 2, 4), (4, 2, 8), (4, 1, 1)])
def test_schedule_runs_v_m_plus_p_minus_1_iterations(stages, repeats, micro):
    assert pipeline.num_iterations(stages, repeats, micro) == repeats * micro + stages - 1
    config = support.small_config(
        stage=stages, repeats=repeats, micro_steps=micro, num_layers=LAYERS
    )
    mesh, setup = support.layout(config)
    tokens = jax.ShapeDtypeStruct((micro, 16 // micro, support.SEQ_LEN + 1), jnp.int32)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(step_lib.make_eval_step(config, setup))(
            setup.abstract_state['params'], tokens
        )
    scan_lengths = [
        eqn.params['length'] for eqn in _all_eqns(jaxpr.jaxpr) if eqn.primitive.name == 'scan'
    ]
    assert pipeline.num_iterations(stages, repeats, micro) in scan_lengths


def _all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations (scan, shard_map)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = value if hasattr(value, 'eqns') else getattr(value, 'jaxpr', None)
            if inner is not None and hasattr(inner, 'eqns'):
                yield from _all_eqns(inner)


@pytest.mark.parametrize('stages,repeats', [(2, 2), (4, 2), (2, 1), (1, 4)])
def test_schedule_order_round_trips_to_layer_order(stages, repeats):
    tree = {'blocks': {'w': jnp.arange(LAYERS * 3).reshape(LAYERS, 3)}, 'token_embed': jnp.ones(2)}
    there = pipeline.to_schedule_order(tree, LAYERS, stages, repeats)
    back = pipeline.to_layer_order(there, LAYERS, stages, repeats)
    np.testing.assert_array_equal(back['blocks']['w'], tree['blocks']['w'])
    per_stage = LAYERS // stages
    for stage in range(stages):  # each stage's slice holds the layers of chunks stage, stage+p...
        layers = there['blocks']['w'][stage * per_stage : (stage + 1) * per_stage, 0] // 3
        chunk_size = LAYERS // (stages * repeats)
        assert {int(layer) // chunk_size % stages for layer in layers} == {stage}


def test_bubble_fraction():
    assert pipeline.bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert pipeline.bubble_fraction(4, 2, 4) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(1, 1, 4) == 0.0
