"""The mixture of experts (model/moe.py), with mesh.expert 1: its grouped matmuls are a dense
per-expert computation's, it compiles to the work of the chosen experts, capacity drops a
sequence's overflow whatever the layout, its loss, gradients and side values under data x
tensor (sequence parallel) and interleaved stage x tensor equal one device's, its aux loss
reaches the gradients, its router bias moves alike under any layout, and selective recompute
keeps its routing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import gpt
from mtnlg_jax.model import moe as moe_lib
from mtnlg_jax.plan import hlo_module

RELATIVE = 2e-5  # of each gradient leaf's and value's largest entry (fp32)
MOE = dict(experts=8, top_k=2, ffn_hidden=32)


def moe_config(**overrides):
    """A resolved model section of small_config's shapes with an MoE of `overrides`."""
    llama = overrides.pop('llama', False)
    model = support.LLAMA_BLOCK if llama else {}
    return support.small_config(**model, moe={**MOE, **overrides}).model


def layer(cfg, grouped='blocks'):
    return moe_lib.MoE(cfg, nnx.Rngs(params=0), grouped)


def dense_reference(layer, rows, group_sizes):
    """Each expert's MLP on every row, each row keeping its own group's: the meaning of a
    grouped matmul (rows past the groups give 0)."""
    group = np.repeat(np.arange(len(group_sizes) + 1), [*group_sizes, len(rows) - sum(group_sizes)])
    out = np.zeros(rows.shape, np.float32)
    for e in range(len(group_sizes)):
        h = rows @ layer.in_kernel[e]
        h = jax.nn.silu(rows @ layer.gate_kernel[e]) * h if layer.swiglu else jax.nn.gelu(h, True)
        out = np.where((group == e)[:, None], h @ layer.out_kernel[e], out)
    return out


@pytest.mark.parametrize('grouped', ['blocks', 'ragged'])
@pytest.mark.parametrize('llama', [False, True])
def test_the_grouped_matmuls_equal_each_experts_mlp_on_its_own_rows(grouped, llama):
    """Groups of uneven sizes, empty ones among them, and rows past the last group (dropped
    choices): the CPU's padded blocks and jax.lax.ragged_dot both give each row its own
    expert's MLP."""
    cfg = moe_config(llama=llama)
    moe = layer(cfg, grouped)
    group_sizes = np.array([5, 0, 17, 1, 0, 30, 9, 2], np.int32)  # 64 of 70 rows
    rows = np.random.default_rng(0).normal(size=(70, cfg.hidden)).astype(np.float32)
    got = moe.grouped_mlp(jnp.asarray(rows), jnp.asarray(group_sizes))
    np.testing.assert_allclose(got, dense_reference(moe, rows, group_sizes), atol=1e-5)


def test_a_width_the_kernels_tiles_cannot_take_runs_the_batched_path():
    """On a GPU the experts take the Pallas kernel (grouped_matmul_kind: 'pallas'), whose tiles
    need sides that are multiples of 16; an expert 40 wide (tiny_moe's are 88) takes the
    padded blocks instead: here on the CPU, where the kernel itself would not run, the rows
    get their experts' MLP."""
    cfg = moe_config(llama=True, ffn_hidden=40)
    moe = layer(cfg, 'pallas')
    group_sizes = np.array([5, 0, 17, 1, 0, 30, 9, 2], np.int32)
    rows = np.random.default_rng(1).normal(size=(70, cfg.hidden)).astype(np.float32)
    got = moe.grouped_mlp(jnp.asarray(rows), jnp.asarray(group_sizes))
    np.testing.assert_allclose(got, dense_reference(moe, rows, group_sizes), atol=1e-5)


def test_routed_scale_multiplies_the_routed_experts_weights_and_nothing_else():
    """model.moe.routed_scale (DeepSeek-V3's routed_scaling_factor): the layer's output (no
    shared expert) times it, the same experts chosen (the side values alike)."""
    x = jax.random.normal(jax.random.key(3), (2, 32, moe_config().hidden))
    plain, values = layer(moe_config())(x, jnp.int32(0))
    scaled, scaled_values = layer(moe_config(routed_scale=2.5))(x, jnp.int32(0))
    np.testing.assert_allclose(scaled, 2.5 * plain, rtol=1e-5, atol=1e-6)
    support.assert_trees_close(scaled_values, values, atol=0.0)


def test_the_compiled_layer_does_the_chosen_experts_work_without_a_dense_dispatch():
    """The matmul FLOPs of the layer's forward compiled by XLA:CPU (the planner's count of
    the optimized HLO, plan/hlo_module.py): within 10 % of the active FLOPs (the router and
    each token's top_k experts), where a dense one-hot dispatch or a ragged dot lowered over
    every expert would be about experts / top_k = 4 times the experts' part."""
    cfg = moe_config()
    moe = layer(cfg)
    graphdef, state = nnx.split(moe)
    x = jnp.ones((8, 32, cfg.hidden), jnp.float32)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, 0)[0])
    flops = hlo_module.dot_flops(forward.lower(state, x).compile().as_text())
    tokens, e, f = 8 * 32, cfg.hidden, MOE['ffn_hidden']
    active = 2 * tokens * e * MOE['experts'] + 2 * tokens * MOE['top_k'] * 2 * e * f
    assert abs(flops / active - 1) < 0.10, f'compiled {flops:.3g} FLOPs, active {active:.3g}'


def test_capacity_keeps_first_choices_first_in_token_order_within_each_sequence():
    """Capacity 0.5 of 4 experts, top 2, sequences of 4 tokens: ceil(0.5 x 4 x 2 / 4) = 1
    slot an expert a sequence. All first choices queue before any second one."""
    cfg = moe_config(experts=4, top_k=2, capacity_factor=0.5)
    chosen = jnp.array(
        [
            [[0, 1], [0, 2], [3, 1], [2, 3]],
            [[1, 0], [1, 0], [1, 0], [1, 0]],
        ]
    )
    keep = layer(cfg).kept(chosen)
    expected = [
        # first choices 0, 0, 3, 2 fill experts 0, 3, 2 (token 1's 0 overflows); of the
        # second choices only token 0's 1 finds a free slot
        [[1, 1], [0, 0], [1, 0], [1, 0]],
        # the first token takes expert 1's slot with its first choice, 0's with its second
        [[1, 1], [0, 0], [0, 0], [0, 0]],
    ]
    np.testing.assert_array_equal(keep, np.array(expected, bool))


def test_the_aux_and_z_losses_are_differentiable_in_the_router():
    """Their gradients in the router's kernel are not zero, and the step adds them to the
    objective (declared differentiable); the loads and drops are not."""
    cfg = moe_config(z_loss_coeff=1e-3)
    graphdef, params, rest = nnx.split(moe_lib.MoE(cfg, nnx.Rngs(params=1)), nnx.Param, ...)
    x = jax.random.normal(jax.random.key(0), (4, 32, cfg.hidden))
    for name in (moe_lib.AUX_LOSS, moe_lib.Z_LOSS):
        grads = jax.grad(lambda p: nnx.merge(graphdef, p, rest)(x, 0)[1][name])(params)
        assert np.abs(grads['router_kernel'][...]).max() > 1e-6, name
    declared = moe_lib.side_values(2, 8)
    assert [n for n, s in declared.items() if s.differentiable] == [
        moe_lib.AUX_LOSS,
        moe_lib.Z_LOSS,
    ]


# GPT's block with a shared expert, dropless, z-loss on, over data 2 x tensor 2 with sequence
# parallelism. The pipelined Llama block (qk norms, the sigmoid router, capacity 1.0, the
# interleaved schedule) goes through stage x expert x tensor in test_expert_parallel.py.
CASES = {
    'gpt-dropless-shared-d2t2-sp': (
        dict(num_layers=2, moe={**MOE, 'shared_experts': 1, 'z_loss_coeff': 1e-3}),
        dict(data=2, tensor=2, sequence_parallel=True),
    ),
}


@pytest.mark.parametrize('case', CASES)
def test_loss_gradients_and_values_under_a_layout_equal_one_devices(case):
    """Loss, every gradient leaf (relative to its scale) and the side values (the aux loss,
    the per-layer loads, the dropped count: the same tokens dropped) equal one device's."""
    model, layout = CASES[case]
    assert_layout_equals_one_device(model, layout)


_ONE_DEVICE = {}  # one device's side of the check below, for each model a process checks


def _one_device(model):
    """(initial params, loss, grads, side values) of one device for `model`: computed once a
    process (test_expert_parallel's layouts share models: capacity 1.0 under context and
    under expert 8). One device exchanges nothing and folds nothing, so model.moe.exchange
    and fold_tensor are not its own (a folded layout is held to the unfolded model)."""
    mesh_only = ('exchange', 'fold_tensor')
    model = {**model, 'moe': {k: v for k, v in model['moe'].items() if k not in mesh_only}}
    key = repr(sorted((k, sorted(v.items()) if k == 'moe' else v) for k, v in model.items()))
    if key not in _ONE_DEVICE:
        batch = support.random_batches(1)[0]
        config = support.small_config(**model)
        _ONE_DEVICE[key] = support.gradients_and_values(config, batch, 5, buffers_after=True)
    return _ONE_DEVICE[key]


def assert_layout_equals_one_device(model, layout, relative=RELATIVE, loss_rtol=1e-6, atol=1e-5):
    """One step's loss, every gradient leaf and side value under `layout` against one
    device's (each within `relative` of its leaf's largest entry, the gradients within `atol`
    too, the loss within `loss_rtol`); capacity drops tokens exactly when the model has a
    capacity factor; every MoE layer's row of the loads counts each token's top_k choices,
    the dense layers' ahead of the experts none; the router bias the train step keeps after
    the batch (step.buffers_after) is one device's in layer order, and moved when the model
    has a bias_update_rate. Returns one device's side values."""
    batch = support.random_batches(1)[0]
    one = _one_device(model)
    config = support.small_config(**layout, **model)
    many = support.gradients_and_values(config, batch, 5, buffers_after=True)
    np.testing.assert_allclose(many[1], one[1], rtol=loss_rtol)
    bias = [run[4]['blocks']['moe']['router_bias'] for run in (many, one)]
    np.testing.assert_array_equal(*bias)
    assert (np.abs(bias[1]).max() > 0) == bool(model['moe'].get('bias_update_rate')), bias[1]
    support.assert_gradients_close(many[2], one[2], atol, relative)
    support.assert_within_leaf_scale(many[3], one[3], relative)
    dropped = float(one[3][moe_lib.DROPPED])
    assert (dropped > 0) == bool(model['moe'].get('capacity_factor')), dropped
    loads, moe = one[3][moe_lib.LOADS], model['moe']
    dense = moe.get('dense_layers', 0)
    assert loads.shape[0] == model.get('num_layers', 2) and not loads[:dense].any()
    choices = support.GLOBAL_BATCH * support.SEQ_LEN * moe.get('top_k', MOE['top_k'])
    np.testing.assert_array_equal(loads[dense:].sum(-1), choices)
    return one[3]


def test_the_router_bias_moves_by_the_loads_alike_on_one_device_and_over_data_expert_tensor():
    """Two train steps with bias_update_rate 1e-3: the buffers after them (moved by the loads
    of the whole batch, summed over every replica and expert rank) are one device's, and not
    their initial zeros (an underloaded expert's bias rose); the steps' metrics carry the side
    values under their names, alike."""
    model = dict(moe={**MOE, 'bias_update_rate': 1e-3})
    batches = support.random_batches(2)
    one_metrics, many_metrics = [], []
    _, one = support.train_losses(support.small_config(**model), batches, one_metrics)
    config = support.small_config(data=2, expert=2, tensor=2, **model)
    _, many = support.train_losses(config, batches, many_metrics)
    for got, expected in zip(many_metrics, one_metrics):
        values = {name: got[name] for name in moe_lib.side_values(2, 8)}
        support.assert_within_leaf_scale(values, {n: expected[n] for n in values}, RELATIVE)
    assert one_metrics[-1][moe_lib.AUX_LOSS] == pytest.approx(0.01 * 2, rel=0.2)  # ~balanced
    bias = jax.device_get(one['buffers'])['blocks']['moe']['router_bias']
    np.testing.assert_allclose(
        jax.device_get(many['buffers'])['blocks']['moe']['router_bias'], bias
    )
    assert np.abs(bias).max() == pytest.approx(2e-3)  # two steps of the rate, some expert


BAD = [
    (dict(moe={**MOE, 'top_k': 9}), {}, 'model.moe.top_k: 9 is above model.moe.experts=8'),
    (dict(moe={**MOE, 'experts': 6}), dict(expert=4), 'not divisible by mesh.expert=4'),
    (dict(), dict(expert=2), 'mesh.expert: 2 expert ranks, but the model is dense'),
    (dict(moe={**MOE, 'capacity_factor': -1.0}), {}, 'model.moe.capacity_factor: must be >= 0'),
    (dict(moe={**MOE, 'router': 'relu'}), {}, "model.moe.router: 'relu' is not one of"),
    (dict(moe={**MOE, 'dense_layers': 12}), {}, 'model.moe.dense_layers: 12 dense layers leave'),
    (dict(moe=dict(dense_layers=1)), {}, 'model.moe.dense_layers: 1 dense layers ahead of the'),
    (
        dict(moe={**MOE, 'dense_layers': 3}),
        dict(stage=2),
        'model.num_layers: 9 MoE layers (model.num_layers less model.moe.dense_layers) are not '
        'divisible by mesh.stage',
    ),
    (
        dict(moe={**MOE, 'ffn_hidden': 320}, fp8='blockwise', compute_dtype='bfloat16'),
        {},
        'blockwise FP8 takes blocks of 128: model.moe.ffn_hidden (320 a tensor rank)',
    ),
    (
        dict(moe={**MOE, 'dense_layers': 2}, fp8='delayed'),
        {},
        "model.moe.dense_layers: 2 dense layers under model.fp8 = 'delayed'",
    ),
]


@pytest.mark.parametrize('model, mesh, message', BAD)
def test_bad_moe_input_is_one_line_naming_the_key(model, mesh, message):
    config = config_lib.defaults()
    config.model.update(model)
    config.mesh.update(dict(data=-1, **mesh))
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.resolve(config, 8)
    assert message in str(error.value) and '\n' not in str(error.value)


def test_selective_recompute_keeps_the_routers_choice_so_the_backward_does_not_route_again():
    """Under selective recompute (model/gpt.py's remat_policy) the layer's backward reads the
    kept `moe_route` values (the top-k choice, the sort by expert): the compiled gradient
    sorts as often as the forward alone, where full recompute routes and sorts again."""
    cfg = moe_config()
    graphdef, state = nnx.split(layer(cfg))
    x = jax.random.normal(jax.random.key(0), (2, 32, cfg.hidden), jnp.float32)

    def output(state, x):
        return nnx.merge(graphdef, state)(x, 0)[0].sum()

    def sorts(function):
        return len(re.findall(r'\bsort\(', function.lower(state, x).compile().as_text()))

    def gradient(remat):  # the loss too: the forward runs, its backward after it
        return jax.jit(jax.value_and_grad(jax.checkpoint(output, policy=gpt.remat_policy(remat))))

    forward = sorts(jax.jit(output))
    assert forward >= 1
    assert sorts(gradient('selective')) == forward
    assert sorts(gradient('full')) > forward
