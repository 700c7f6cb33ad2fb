"""The pipeline schedules against the plain sequential model on one device.

Gradients are compared per leaf, relative to the leaf's scale (support.assert_gradients_close).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import branches, grad_reduce, pipeline, stage_order
from mtnlg_jax.parallel import schedule as schedule_lib
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.train import step as step_lib

LAYERS = 4
DROPOUT = dict(attention_dropout=0.1, hidden_dropout=0.1)
# (data, stage, tensor, repeats, micro-batches m, schedule, model overrides)
D2S2T2_1F1B = (2, 2, 2, 1, 4, '1f1b', {})
D2S2T2_INTERLEAVED = (2, 2, 2, 2, 4, 'interleaved', {})
D2S2T2_GPIPE = (2, 2, 2, 2, 4, 'gpipe', {})
# Loss and gradients against one device. These layouts are held to it in other files' cases,
# which compile them once for both (docs/benchmarks.md, "The test suite's time"):
# d2s2t2v1m4-1f1b and d1s4t2v1m8-zbh1 (B and W slots) with the toy side values
# (test_side_values.py, the same configs, initial parameters included); d2s2t2v2m4-interleaved
# below with sequence parallelism and packed with Llama's block (test_packing.py);
# d2s2t2v2m4-gpipe packed (test_packing.py) and over data 2 x stage 2 (test_side_values.py).
STEADY = dict(steady_tick=True)  # pipeline.steady_tick: the tick as one switch over slot pairs
# pipeline.overlap_grad_reduce: ZeRO-1's reduce-scatter in the loop (parallel/grad_reduce.py);
# 1F1B's one chunk finishes last: all of it after the loop, inside the engine
OVERLAP = dict(overlap_grad_reduce=True)
# and pipeline.overlap_param_gather: the blocks' compute copy gathered chunk by chunk in it;
# there and in the steady tick's layout with the MLP's input held in host memory
# (model.remat_offload, parallel/offload.py): the reducing and gathering ticks' residual slots
# read before their forward's write, the steady tick's read before its switch
GATHER = dict(overlap_grad_reduce=True, overlap_param_gather=True)
OFFLOAD = dict(remat='selective', remat_offload='mlp_in')
PIPELINE_KEYS = ('steady_tick', 'overlap_grad_reduce', 'overlap_param_gather')
LAYOUTS = [
    # m < p, m not a multiple of p, dropout on; the steady tick (its edges: most of the table)
    (1, 4, 2, 1, 2, '1f1b', {**DROPOUT, **STEADY, **OFFLOAD}),
    (1, 2, 4, 2, 2, 'interleaved', {}),  # m = p with v > 1; tensor 4 splits the hand-offs
    (2, 2, 2, 2, 4, 'interleaved', dict(sequence_parallel=True)),
    (2, 2, 2, 1, 4, 'zbh1', DROPOUT),  # the last chunk's B runs its forward: same masks
    (2, 2, 2, 2, 4, 'interleaved', dict(sequence_parallel=True, **OVERLAP)),
    (2, 2, 2, 1, 4, '1f1b', OVERLAP),
    (2, 2, 2, 2, 4, 'interleaved', {**GATHER, **OFFLOAD}),
]
# Their train steps' losses, step after step (the optimizer's update under stage x data, ZeRO
# included): test_resume.py's two layout cases run 5 steps each after the restore under
# d2s2t2v1m4 1F1B and d2s2t2v2m4 interleaved, within 1e-4 of the unpipelined run's losses.


def _name(layout):
    data, stage, tensor, repeats, micro, schedule, model = layout
    extra = (
        ('-dropout' if 'hidden_dropout' in model else '')
        + ('-sequence_parallel' if 'sequence_parallel' in model else '')
        + ('-steady' if model.get('steady_tick') else '')
        + ('-overlap_grad_reduce' if model.get('overlap_grad_reduce') else '')
        + ('-overlap_param_gather' if model.get('overlap_param_gather') else '')
        + ('-offload' if model.get('remat_offload') else '')
    )
    return f'd{data}s{stage}t{tensor}v{repeats}m{micro}-{schedule}{extra}'


def _config(layout, **more):
    data, stage, tensor, repeats, micro, schedule, model = layout
    model = dict(model)
    keys = {key: model.pop(key, False) for key in PIPELINE_KEYS}
    config = support.small_config(
        data, stage, tensor, micro, repeats, schedule, num_layers=LAYERS, **model, **more
    )
    config.pipeline.update(keys)
    return config


def relative_error(grads, reference):
    """|grads - reference| / |reference| over all leaves (L2)."""
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(reference))
    diff = sum(float(np.sum(np.square(g - r))) for g, r in pairs)
    norm = sum(float(np.sum(np.square(r))) for r in jax.tree.leaves(reference))
    return np.sqrt(diff / norm)


@pytest.fixture(scope='module')
def one_device():
    batch = support.random_batches(1)[0]
    config = support.small_config(num_layers=LAYERS)
    params, loss, grads = support.gradients(config, batch, step=5)
    _, loss_dropout, grads_dropout = support.gradients(
        support.small_config(num_layers=LAYERS, **DROPOUT), batch, step=5
    )
    return dict(
        params=params, loss=loss, grads=grads, dropout=dict(loss=loss_dropout, grads=grads_dropout)
    )


@pytest.mark.parametrize('layout', LAYOUTS, ids=_name)
def test_loss_and_gradients_match_one_device(one_device, layout):
    params, loss, grads = support.gradients(_config(layout), support.random_batches(1)[0], step=5)
    expected = one_device['dropout'] if 'hidden_dropout' in layout[-1] else one_device
    support.assert_trees_close(params, one_device['params'], atol=0.0)
    np.testing.assert_allclose(loss, expected['loss'], rtol=1e-6)
    support.assert_gradients_close(grads, expected['grads'])


def test_the_reduce_scatter_in_the_loop_over_data_and_context_matches_one_device(one_device):
    """pipeline.overlap_grad_reduce under context parallelism: each context rank's partial
    sums of a chunk's gradients reduce-scattered over its ZeRO axes (context here) inside the
    loop; interleaved over 2 stages, sequence parallel over tensor 2."""
    config = support.small_config(
        1, 2, 2, 4, 2, 'interleaved', context=2, num_layers=LAYERS, sequence_parallel=True
    )
    config.pipeline.update(overlap_grad_reduce=True)
    params, loss, grads = support.gradients(config, support.random_batches(1)[0], step=5)
    support.assert_trees_close(params, one_device['params'], atol=0.0)
    np.testing.assert_allclose(loss, one_device['loss'], rtol=1e-6)
    support.assert_gradients_close(grads, one_device['grads'])


@pytest.mark.parametrize(
    'layout, bound',
    [
        ((1, 4, 2, 1, 8, '1f1b', {}), 4),
        ((1, 2, 2, 2, 8, 'interleaved', {}), 2),
        ((1, 4, 2, 1, 8, 'zbh1', {}), 3),
    ],
    ids=['1f1b-p', 'interleaved-2', 'zbh1-3'],
)
def test_a_bounded_table_matches_one_device(one_device, layout, bound):
    """pipeline.max_in_flight: with one chunk a stage Megatron's bound of p stage inputs per
    stage; interleaved, at most `bound` micro-batches in the pipeline (v chunk inputs each a
    stage). Reached with idle ticks; the same loss and gradients."""
    config = _config(layout)
    config.pipeline.max_in_flight = bound
    _, stages, _, repeats, micro, schedule = layout[:6]
    bounded = pipeline.build_table(stages, repeats, micro, bound, schedule)
    greedy = pipeline.build_table(stages, repeats, micro, 0, schedule)
    assert bounded.in_flight().max() <= bound * repeats < greedy.in_flight().max()
    assert bounded.resid_slots < greedy.resid_slots and bounded.ticks > greedy.ticks
    _, loss, grads = support.gradients(config, support.random_batches(1)[0], step=5)
    np.testing.assert_allclose(loss, one_device['loss'], rtol=1e-6)
    support.assert_gradients_close(grads, one_device['grads'])


BF16 = dict(num_layers=LAYERS, compute_dtype='bfloat16')


@pytest.fixture(scope='module')
def bf16_error(one_device):
    """The unpipelined bf16 step's gradient error against the fp32 gradients."""
    batch = support.random_batches(1)[0]
    _, _, plain = support.gradients(support.small_config(micro_steps=8, **BF16), batch, step=5)
    return relative_error(plain, one_device['grads'])


@pytest.mark.parametrize('schedule', ['1f1b', 'zbh1'])
def test_bf16_gradient_error_no_worse_than_unpipelined(one_device, bf16_error, schedule):
    """Against the fp32 gradients: the pipeline sums in fp32 accumulators, so its bf16 error
    is that of the unpipelined step's (within 10 %); the kernels' dW (zbh1's W, the others'
    backward) contracts bf16 taps x and dy into fp32, into the accumulator."""
    batch = support.random_batches(1)[0]
    config = support.small_config(stage=2, micro_steps=8, schedule=schedule, **BF16)
    _, _, piped = support.gradients(config, batch, step=5)
    assert 1e-4 < bf16_error < 0.05  # bf16 is visibly off, and not broken
    assert relative_error(piped, one_device['grads']) <= 1.1 * bf16_error


# The interleaved table's idle slots: test_side_values.py's NaN test (the same layout and
# checks, its toy values beside).
@pytest.mark.parametrize('schedule', ['zbh1'])
def test_idle_slots_filled_with_nan_never_reach_loss_or_gradients(schedule):
    repeats = 2 if schedule == 'interleaved' else 1
    config = support.small_config(stage=2, repeats=repeats, micro_steps=4, num_layers=LAYERS)
    mesh, setup = support.layout(config)
    tokens = jnp.asarray(support.random_batches(1)[0].reshape(4, 4, -1), jnp.int32)
    table = pipeline.build_table(2, repeats, 4, schedule=schedule)
    assert (table.fwd_micro == schedule_lib.IDLE).any()  # the table has idle slots
    stage_fns = gpt.stage_functions(setup.graphdef)
    run = jax.jit(
        lambda params, fill: pipeline.run_schedule(
            stage_fns, params, tokens, None, table, with_grads=True, bubble_fill=fill
        )
    )
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        clean = run(state['params'], jnp.float32(0.0))
        poisoned = run(state['params'], jnp.float32(jnp.nan))
    assert np.isfinite(poisoned[0])
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(poisoned[2]))
    np.testing.assert_array_equal(poisoned[0], clean[0])
    support.assert_trees_close(poisoned[2], clean[2], atol=0.0)


def test_each_stage_holds_only_its_own_blocks_and_their_optimizer_state():
    config = support.small_config(data=2, stage=2, tensor=2, repeats=2, num_layers=8)
    mesh, setup = support.layout(config)
    state = state_lib.init_state(config, setup)
    kernel = state['params']['blocks']['mlp']['in_kernel']  # (layers 8, embed 64, mlp 256)
    moment = state['opt_state'][1].mu['blocks']['mlp']['in_kernel']
    for array in (kernel, moment):
        assert array.sharding.spec[0] == 'stage'
        # 8 layers over 2 stages; embed split by ZeRO over data; mlp over tensor.
        assert array.addressable_shards[0].data.shape == (4, 32, 128)
    first_stage_layers = stage_order.schedule_order(8, stages=2, repeats=2)[:4]
    assert list(first_stage_layers) == [0, 1, 4, 5]  # chunks 0 and 2 of 2 layers each


def eval_sums(config, batch):
    """(summed loss, token count) of the eval step on one global batch, initial parameters."""
    mesh, setup = support.layout(config)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, _ = batch_lib.place_batch(
            *batch_lib.to_micro_steps(batch.astype(np.int32), config.train.micro_steps), mesh
        )
        loss_sum, count = step_lib.make_eval_step(config, setup)(state['params'], tokens)
    return float(loss_sum), float(count)


def _eval_loss(config, batch):
    loss_sum, count = eval_sums(config, batch)
    return loss_sum / count


def test_pipelined_sequence_parallel_eval_loss_equals_one_device(one_device):
    """The eval step on data x stage x tensor with sequence parallelism runs (no collective
    that only some stages reach) and gives the one-device loss (the gradient step's: no
    dropout, every token counted)."""
    batch = support.random_batches(1)[0]
    layout = (2, 2, 2, 1, 4, '1f1b', dict(sequence_parallel=True))
    np.testing.assert_allclose(_eval_loss(_config(layout), batch), one_device['loss'], rtol=1e-6)


@pytest.mark.parametrize('schedule,ticks', [('1f1b', 4 + 2 * 2 - 2), ('gpipe', 2 * 4 + 2 - 1)])
def test_one_scan_runs_the_schedules_ticks(schedule, ticks):
    """The eval step scans the table's ticks (1f1b) or v m + p - 1 iterations (gpipe)."""
    repeats = 2 if schedule == 'gpipe' else 1
    config = support.small_config(
        stage=2, repeats=repeats, micro_steps=4, schedule=schedule, num_layers=LAYERS
    )
    assert pipeline.num_ticks(2, config.pipeline.repeats, 4, schedule) == ticks
    mesh, setup = support.layout(config)
    tokens = jax.ShapeDtypeStruct((4, 4, support.SEQ_LEN + 1), jnp.int32)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(step_lib.make_eval_step(config, setup))(
            setup.abstract_state['params'], tokens
        )
    scan_lengths = [
        eqn.params['length'] for eqn in _all_eqns(jaxpr.jaxpr) if eqn.primitive.name == 'scan'
    ]
    assert ticks in scan_lengths


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
    layers = 8
    tree = {'blocks': {'w': jnp.arange(layers * 3).reshape(layers, 3)}, 'token_embed': jnp.ones(2)}
    there = stage_order.to_schedule_order(tree, layers, stages, repeats)
    back = stage_order.to_layer_order(there, layers, stages, repeats)
    np.testing.assert_array_equal(back['blocks']['w'], tree['blocks']['w'])
    per_stage = layers // stages
    for stage in range(stages):  # each stage's slice holds the layers of chunks stage, stage+p...
        held = there['blocks']['w'][stage * per_stage : (stage + 1) * per_stage, 0] // 3
        chunk_size = layers // (stages * repeats)
        assert {int(layer) // chunk_size % stages for layer in held} == {stage}


def test_bubble_fraction():
    assert pipeline.bubble_fraction(4, 1, 4, 'gpipe') == pytest.approx(3 / 7)
    assert pipeline.bubble_fraction(4, 2, 4, 'gpipe') == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(1, 1, 4) == 0.0
    assert pipeline.bubble_fraction(4, 1, 64) == pytest.approx(3 / 67, abs=0.02)


def test_what_every_stage_holds_is_summed_over_stage_and_data_in_either_zero_split():
    """The embeddings and final norm every stage holds: ZeRO-1 over ('stage', 'data') together
    where a whole dimension divides by both (the 32 positions over 8 here), over 'data' alone
    where only it does (a width of 12 over 4 replicas, not 8): either way the stages' shares
    and the replicas' sums add up to one device's gradients, leaf by leaf."""
    model = dict(num_layers=LAYERS, hidden=12, heads=4)
    config = support.small_config(data=4, stage=2, micro_steps=4, **model)
    _, setup = support.layout(config)
    shardings = setup.state_shardings['params']
    assert shardings['position_embed'].spec == PartitionSpec(('stage', 'data'), None)
    assert shardings['token_embed'].spec == PartitionSpec('tensor', 'data')
    assert shardings['final_norm']['scale'].spec == PartitionSpec('data')
    batch = support.random_batches(1)[0]
    _, loss, grads = support.gradients(config, batch, step=5)
    _, expected_loss, expected = support.gradients(support.small_config(**model), batch, step=5)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    support.assert_gradients_close(grads, expected)


def test_zbh1_refuses_more_than_one_chunk_a_stage_naming_the_key():
    """The config check, before a compile."""
    with pytest.raises(config_lib.ConfigError, match='zbh1') as error:
        support.small_config(stage=2, repeats=2, micro_steps=4, schedule='zbh1', num_layers=4)
    assert error.value.key == 'pipeline.repeats'


def test_overlap_grad_reduce_refuses_the_steady_tick_naming_the_key():
    """The config check, before a compile: the reduce-scatter rides the tick by slot, and the
    in-loop all-gather the reduce-scatter's engine."""
    config = support.small_config(stage=2, repeats=2, micro_steps=4, num_layers=4)
    config = config_lib.inputs_of(config)
    config.pipeline.update(overlap_grad_reduce=True, steady_tick=True)
    with pytest.raises(config_lib.ConfigError, match='steady_tick') as error:
        config_lib.resolve(config, 2)
    assert error.value.key == 'pipeline.overlap_grad_reduce'
    config.pipeline.update(overlap_grad_reduce=False, steady_tick=False, overlap_param_gather=True)
    with pytest.raises(config_lib.ConfigError, match='overlap_grad_reduce') as error:
        config_lib.resolve(config, 2)
    assert error.value.key == 'pipeline.overlap_param_gather'


def test_overlap_grad_reduce_plans_each_finished_layer_once_after_its_chunks_last_backward():
    """grad_reduce.plan on the 405B's table (16 stages, 4 chunks of 2 layers, 32 micro-batches,
    at most 16 in flight): on every stage chunks 3, 2 and 1 are reduce-scattered a layer a
    slot, each once, in a later backward slot of another chunk from its stash; chunk 0, the
    last to finish, after the loop; the plan's weights of the switch sum to one."""
    table = pipeline.build_table(16, 4, 32, 16, 'interleaved')
    plan = grad_reduce.plan(table, 2)
    assert plan.after == ((0, 0), (0, 1))
    _, kinds = branches.slot_kinds(table)
    for s in range(16):
        slots = np.nonzero(plan.chunk[:, s] >= 0)[0]
        reduced = sorted(zip(plan.chunk[slots, s], plan.layer[slots, s]))
        assert reduced == [(k, n) for k in (1, 2, 3) for n in (0, 1)]
        for t in slots:
            k = plan.chunk[t, s]
            finished = np.nonzero((table.bwd_repeat[:, s] == k) & (table.bwd_micro[:, s] >= 0))[0]
            assert t > finished.max() and table.bwd_repeat[t, s] != k
            assert kinds[t, s] in (branches.SLOT_MIDDLE, branches.SLOT_FIRST)
            assert plan.variants[plan.branch[t, s] - 4] == (
                table.bwd_repeat[t, s],
                k,
                plan.layer[t, s],
            )
    weights = grad_reduce.fractions(table, plan, branches.branch_fractions(table))
    assert np.isclose(sum(weights[(branches.BACKWARD, branches.REDUCE)]), 1.0)


def test_overlap_param_gather_plans_each_later_layer_once_in_the_first_ticks():
    """grad_reduce.gather_plan on the 405B's table: the 16 ticks before any stage runs chunk 1
    run chunk 0's forwards alone; on every stage each layer of chunks 1, 2 and 3 is gathered
    once there, in a forward slot while the stage has one (stage s has 16 - s), then in an
    idle one; the weights of the forward's switch there sum to one."""
    table = pipeline.build_table(16, 4, 32, 16, 'interleaved')
    plan = grad_reduce.gather_plan(table, 2)
    assert plan.branch.shape == (16, 16) and plan.after == ()
    fwd, _ = branches.slot_kinds(table)
    assert (table.fwd_repeat[:16][fwd[:16] != branches.SLOT_IDLE] == 0).all()
    for s in range(16):
        slots = np.nonzero(plan.chunk[:, s] >= 0)[0]
        gathered = sorted(zip(plan.chunk[slots, s], plan.layer[slots, s]))
        assert gathered == [(k, n) for k in (1, 2, 3) for n in (0, 1)]
        ran = fwd[slots, s] != branches.SLOT_IDLE
        assert ran.sum() == min(6, 16 - s)
        for t in slots:
            assert plan.variants[plan.branch[t, s] - 2] == (
                int(fwd[t, s] != branches.SLOT_IDLE),
                plan.chunk[t, s],
                plan.layer[t, s],
            )
    weights = grad_reduce.gather_fractions(table, plan, {})
    assert np.isclose(sum(weights[(branches.FORWARD, branches.GATHER)]), 1.0)


@pytest.mark.parametrize('gather', [False, True])
def test_the_step_with_gathering_ticks_asks_xla_for_more_collectives_in_flight(gather):
    """pipeline.overlap_param_gather's train step carries XLA's option for 8 collectives in
    flight (grad_reduce.compiler_options: at the process's 4 the 405B's gathers start after
    the forward they should hide behind); the reduce-scatter alone asks nothing of the kind.
    Lowered only."""
    keys = GATHER if gather else dict(overlap_grad_reduce=True)
    config = support.small_config(
        data=2, stage=2, repeats=2, schedule='interleaved', micro_steps=4, num_layers=4
    )
    config = config_lib.inputs_of(config)
    config.pipeline.update(keys)
    config = config_lib.resolve(config, 4)
    mesh, setup = compile_lib.layout(config)
    batch = loader_lib.abstract_train_batch(config, mesh, config.train.micro_steps)
    args = (compile_lib.abstract_state(setup), *batch, jax.ShapeDtypeStruct((), jnp.float32))
    with jax.set_mesh(mesh):
        lowered = step_lib.make_train_step(config, setup).lower(*args)
    options = dict(lowered._lowering._compiler_options_kvs)
    limit = options.get(grad_reduce.OVERLAP_LIMIT_OPTION)
    assert limit == (grad_reduce.GATHER_COLLECTIVES_IN_FLIGHT if gather else None)
