"""Expert parallelism (mesh.expert; parallel/rules.py, model/moe.py's exchange): an MoE block
under data x expert x tensor, expert x tensor with sequence parallelism (the attention on
sequence pieces), stage x expert x tensor interleaved and plain 1F1B on stages of unequal
depth, context x expert x tensor under full recompute and expert 8 alone computes one
device's loss, every gradient leaf and side value (dropless, and with capacity 1.0 the same
tokens dropped: under context too, where the sequence is held in the chunk order), and the
router bias the step keeps after the batch; GPT's and Llama's blocks, a dense layer ahead of
the experts (model.moe.dense_layers) unpipelined and pipelined, and bf16 against one device in
bf16; the eval step scores alike; a checkpoint with a dense layer restores under another
expert layout and a pipelined one; the compiled step carries the tokens by all-to-all over
'expert'; the experts' state is split over 'expert' and ZeRO-1 over 'data' alone; bad input
is one line."""

import jax
import numpy as np
import pytest

import support
import test_checkpoint
import test_moe
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax import config as config_lib
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import comm, hlo, hlo_module, report
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.train import resume
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.train import step as step_lib

RELATIVE = 1e-5  # of each gradient leaf's and value's largest entry (fp32)
# A shared expert beside the routed ones, the aux loss and the router bias update on.
MOE = {**test_moe.MOE, 'shared_experts': 1, 'aux_loss_coeff': 0.01, 'bias_update_rate': 1e-3}
CAPACITY = {**MOE, 'capacity_factor': 1.0, 'router': 'sigmoid'}
RAGGED = {**MOE, 'exchange': 'ragged'}
LLAMA = dict(**support.LLAMA_BLOCK, qk_norm=True)

# A dense layer ahead of two MoE layers (its own stack, run with the embedding).
DENSE_FIRST = dict(num_layers=3, moe={**MOE, 'dense_layers': 1})

# Llama's: a dense layer ahead of four MoE layers (pipelined: two stages of two chunks, or
# plain 1F1B on stages of 1 and 3).
LLAMA_DENSE_FIRST = dict(num_layers=5, **LLAMA, moe={**CAPACITY, 'dense_layers': 1})

# (model keys, layout keys): every layout, GPT and Llama, dropless and capacity 1.0, a dense
# layer ahead of the experts unpipelined and pipelined (the first stage runs it beside its
# MoE layers) each appear (a covering set, not the product: each case compiles its step; the
# folded cases share the unfolded ones' models, so one device's reference is computed once)
CASES = {
    'gpt-dropless-dense1-d2e2t2': (DENSE_FIRST, dict(data=2, expert=2, tensor=2)),
    # the ragged exchange (the CPU's emulation: the offsets the GPU's collective takes)
    'llama-dropless-ragged-e2t2-sp-pieces2': (  # the attention on 2 pieces of a sequence
        dict(**LLAMA, moe=RAGGED),
        dict(expert=2, tensor=2, sequence_parallel=True, sequence_pieces=2),
    ),
    # each sequence over context ranks in the chunk order: capacity queues in sequence order
    'gpt-capacity-c2e2t2-sp-full': (  # full recompute
        dict(moe=CAPACITY),
        dict(context=2, expert=2, tensor=2, sequence_parallel=True, remat='full'),
    ),
    'llama-capacity-dense1-s2e2t2v2': (
        LLAMA_DENSE_FIRST,
        dict(stage=2, expert=2, tensor=2, micro_steps=4, repeats=2, schedule='interleaved'),
    ),
    'gpt-capacity-ragged-e8': (dict(moe={**CAPACITY, 'exchange': 'ragged'}), dict(expert=8)),
    # parallel folding (model.moe.fold_tensor): the experts over expert x tensor, whole; plain
    # 1F1B on stages of 1 and 3 MoE layers (the dense one beside the first's)
    'llama-capacity-fold-dense1-s2e2t2-sp-1f1b-first1-selective': (  # exchanged rows kept
        dict(LLAMA_DENSE_FIRST, moe={**LLAMA_DENSE_FIRST['moe'], 'fold_tensor': True}),
        dict(stage=2, expert=2, tensor=2, micro_steps=4, first_stage_layers=1)
        | dict(sequence_parallel=True, remat='selective'),
    ),
    # DENSE_FIRST folded: one device's reference is the first case's
    'gpt-dropless-ragged-fold-dense1-d2e2t2': (
        dict(DENSE_FIRST, moe={**DENSE_FIRST['moe'], **RAGGED, 'fold_tensor': True}),
        dict(data=2, expert=2, tensor=2),
    ),
    # bf16 against one device in bf16, every token to all 8 experts: top 2 flips 14 of 2,048
    # choices at expert 8 (bf16's rounding of the router's input differs by layout), moving
    # expert leaves' gradients by 18 to 22 % of their scale; with no choice to flip the loads
    # are one device's and the gradients within BF16 (docs/benchmarks.md)
    'gpt-dropless-top8of8-d2e2t2-bf16': (
        dict(moe={**MOE, 'top_k': 8, 'bias_update_rate': 0.0}, compute_dtype='bfloat16'),
        dict(data=2, expert=2, tensor=2),
    ),
}
# bf16's: measured at d2e2t2, e2t2 sp and e8, the worst leaf 3.7e-2 of its scale (a bias: a
# sum over every token), the loss 4.3e-6 apart; per leaf, no absolute bound
BF16 = dict(relative=0.1, loss_rtol=5e-5, atol=np.inf)


@pytest.mark.parametrize('case', CASES)
def test_loss_gradients_and_values_under_expert_parallelism_equal_one_devices(case):
    """Loss, every gradient leaf (relative to its scale) and the side values (aux loss, the
    per-layer loads, the dropped count: the same tokens dropped) equal one device's."""
    model, layout = CASES[case]
    bf16 = model.get('compute_dtype') == 'bfloat16'
    tolerances = BF16 if bf16 else dict(relative=RELATIVE)
    test_moe.assert_layout_equals_one_device(model, layout, **tolerances)


def eval_loss(config, batch):
    """The eval step's (loss sum, token count) of one global batch from the initial state."""
    mesh, setup = support.layout(config)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, _ = batch_lib.place_batch(
            *batch_lib.to_micro_steps(batch.astype(np.int32), config.train.micro_steps), mesh
        )
        step = step_lib.make_eval_step(config, setup)
        return jax.device_get(step(state['params'], tokens, state['buffers']))


def test_the_eval_step_under_expert_parallelism_equals_one_devices():
    """Validation without a pipeline runs in the replica region too, where the experts are
    each rank's own: data 2 x expert 2 x tensor 2 scores one device's loss sum and count."""
    batch = support.random_batches(1)[0]
    one = eval_loss(support.small_config(moe=CAPACITY), batch)
    many = eval_loss(support.small_config(data=2, expert=2, tensor=2, moe=CAPACITY), batch)
    np.testing.assert_allclose(many, one, rtol=1e-6)


def test_the_compiled_step_sends_tokens_to_their_experts_by_all_to_all():
    """data 2 x expert 2 x tensor 2: the train step's HLO has all-to-alls among expert ranks
    alone (in the scanned block: 2 forward, their 2 transposes backward); the expert weights'
    fp32 state is split over 'expert' by expert and over 'data' alone by ZeRO-1, the rest over
    ('data', 'expert'). On mesh.expert 1 there is no all-to-all."""
    config = support.small_config(data=2, expert=2, tensor=2, moe=MOE, remat='none')
    compiled, _, info = compile_lib.compile_train_step(config)
    mesh = info['mesh']
    exchanges = all_to_all_axes(compiled, mesh)
    assert len(exchanges) >= 4 and set(exchanges) == {('expert',)}, exchanges
    shardings = info['setup'].state_shardings['params']['blocks']
    expert_spec = tuple(shardings['moe']['in_kernel'].spec)  # (layers, experts, embed, width)
    assert expert_spec[1] == 'expert' and expert_spec[2] == 'data', expert_spec
    assert ('data', 'expert') in tuple(shardings['ln_mlp']['scale'].spec)
    assert_planned_as_compiled(config, compiled, mesh)
    single = support.small_config(data=4, tensor=2, moe=MOE, remat='none')
    assert 'all-to-all' not in compile_lib.compile_train_step(single)[0].as_text()


def test_folded_the_tokens_travel_over_expert_x_tensor_to_whole_experts():
    """model.moe.fold_tensor, data 2 x expert 2 x tensor 2: the all-to-alls span expert x
    tensor, the experts' weights split over both by expert (each whole: no width split),
    and the planned bytes match the compiled ones: the all-to-alls over expert+tensor (each
    tensor rank its 1/t share of the dropless buffers), the exchange's reduce-scatter of the
    tokens' sums over tensor, and the tensor all-reduces, the attention's and the shared
    expert's alone: none on the experts' rows (dropless, 4 x the tokens'). Under selective
    recompute the exchanged rows are kept: 4 all-to-alls a layer pass, not 6."""
    config = support.small_config(
        data=2, expert=2, tensor=2, remat='selective', moe={**MOE, 'fold_tensor': True}
    )
    compiled, _, info = compile_lib.compile_train_step(config)
    mesh = info['mesh']
    exchanges = set(all_to_all_axes(compiled, mesh))
    assert exchanges == {('expert', 'tensor')}, exchanges
    shardings = info['setup'].state_shardings['params']['blocks']
    spec = tuple(shardings['moe']['in_kernel'].spec)  # (layers, experts, embed, width)
    assert spec[1] == ('expert', 'tensor') and spec[3] is None, spec
    assert_planned_as_compiled(config, compiled, mesh, exchange='expert+tensor')


def all_to_all_axes(compiled, mesh):
    """The mesh axes each all-to-all of a compiled step spans."""
    computations, _ = hlo_module.parse_module(compiled.as_text())
    return [
        hlo.spanned_axes(
            hlo.replica_groups(i, mesh.size), mesh.axis_names, tuple(mesh.shape.values())
        )
        for instructions in computations.values()
        for i in instructions
        if i.opcode in ('all-to-all', 'all-to-all-start')
    ]


def assert_planned_as_compiled(config, compiled, mesh, tolerance=0.1, exchange='expert'):
    """The planner's bytes one device sends per step (plan/comm.py) against the compiled
    inventory's, within `tolerance`: ZeRO-1 over 'data' (the experts) and over data x expert
    (the rest), the all-to-alls of the exchange's dropless buffers over `exchange` ('expert',
    folded 'expert+tensor'), and the tensor all-reduces, the experts' on those buffers' rows
    (unfolded)."""
    inventory = hlo.collective_inventory(compiled.as_text(), mesh)
    got = report.compiled_comm(inventory)
    planned = comm.comm_bytes_per_device(config)
    pairs = [('reduce-scatter', 'data'), ('reduce-scatter', 'data+expert')]
    pairs += [('all-gather', 'data'), ('all-gather', 'data+expert')]
    pairs += [('all-to-all', exchange)]
    # over tensor the all-reduces, and the reduce-scatters where planned (folded: the
    # exchange's); not the all-gathers, which XLA:CPU adds where it re-gathers the residual
    kinds = ('all-reduce', 'reduce-scatter')
    pairs += [(kind, 'tensor') for kind in kinds if 'tensor' in planned.get(kind, {})]
    for kind, axes in pairs:
        want = planned[kind][axes]
        assert abs(got[kind][axes] - want) <= tolerance * want, (kind, axes, got, planned)


def test_a_checkpoint_restores_under_another_expert_layout(tmp_path):
    """A state saved after a step under expert 4 (the experts split 4 ways, ZeRO over 4
    replicas, the router bias moved by the MoE layers' loads) restores bit for bit under
    expert 2 x tensor 2, stage 2 x expert 2 x tensor 2 (the dense layer held by both stages),
    on one device and folded (model.moe.fold_tensor: whole experts over expert x tensor)."""
    config = support.small_config(expert=4, **DENSE_FIRST)
    _, state = support.train_losses(config, support.random_batches(1))
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    checkpoints.save(1, state, resume.checkpoint_meta(config, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()
    saved = jax.device_get(state)
    assert np.abs(saved['buffers']['blocks']['moe']['router_bias']).max() > 0
    folded = dict(DENSE_FIRST, moe={**DENSE_FIRST['moe'], 'fold_tensor': True})
    layouts = [dict(expert=2, tensor=2), dict(stage=2, expert=2, tensor=2), dict()]
    for layout, model in [*((layout, DENSE_FIRST) for layout in layouts), (layouts[0], folded)]:
        other = support.small_config(**layout, **model)
        restored, _, _ = test_checkpoint.restore_into(tmp_path, other)
        support.assert_trees_close(support.in_layer_order(other, restored), saved, atol=0)


BAD = [
    (dict(), dict(expert=2), 'mesh.expert: 2 expert ranks, but the model is dense'),
    (dict(moe={**MOE, 'experts': 6}), dict(expert=4), 'not divisible by mesh.expert=4'),
    (
        dict(moe=MOE),
        dict(expert=8, data=1),
        'train.global_batch: 4 is not divisible by train.micro_batch x mesh.data x mesh.expert',
    ),
]


FOLD = {**MOE, 'fold_tensor': True}
BAD += [
    (
        dict(moe={**FOLD, 'experts': 4}),
        dict(expert=2, tensor=4, data=1),
        'model.moe.fold_tensor: 4 experts are not divisible by mesh.expert x mesh.tensor=8',
    ),
    (
        dict(moe=FOLD),
        dict(expert=2, tensor=2, context=2, data=1),
        'model.moe.fold_tensor: mesh.context=2: capacity counts whole sequences',
    ),
]


@pytest.mark.parametrize('model, mesh, message', BAD)
def test_bad_expert_layouts_are_one_line_naming_the_key(model, mesh, message):
    config = config_lib.defaults()
    config.model.update(model)
    config.mesh.update(mesh)
    config.train.update(dict(global_batch=4, micro_batch=1))
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.resolve(config, 8)
    assert message in str(error.value) and '\n' not in str(error.value)
