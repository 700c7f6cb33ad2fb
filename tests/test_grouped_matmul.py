"""The grouped matmul (model/grouped_matmul.py): each expert's rows times its own weights,
equal to a dense per-row reference, gradients included, whatever the group sizes (an empty
expert, a group not a whole tile, every row on one expert); compiled for an H100, three Triton
kernels the planner counts at the active work plus the tiles' padding, and no dense matmul
over every expert (what jax.lax.ragged_dot compiles to)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtnlg_jax.model import grouped_matmul as gm
from mtnlg_jax.xla import gpu_compile
from support import assert_within_leaf_scale

EXPERTS, K, N = 4, 64, 128


def _grouped(tile, interpret=True):
    """x (rows, K) sorted by expert, w (experts, K, N), sizes -> (rows, N) through the tiles."""

    def run(x, w, sizes):
        layout = gm.tile_layout(sizes, x.shape[0], tile)
        out = gm.grouped_matmul(gm.to_tiles(x, layout), w, layout, interpret=interpret)
        return gm.from_tiles(out, layout)

    return run


def _reference(x, w, sizes):
    expert = jnp.repeat(jnp.arange(w.shape[0]), sizes, total_repeat_length=x.shape[0])
    return jnp.einsum('mk,mkn->mn', x, w[expert])


@pytest.mark.parametrize('sizes', [(10, 0, 33, 7), (0, 0, 50, 0), (16, 16, 16, 2)])
def test_each_experts_rows_times_its_own_weights_gradients_included(sizes):
    rows = sum(sizes)
    x = jax.random.normal(jax.random.key(0), (rows, K))
    w = jax.random.normal(jax.random.key(1), (EXPERTS, K, N))
    cotangent = jax.random.normal(jax.random.key(2), (rows, N))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    ours, pull = jax.vjp(lambda x, w: _grouped(tile=16)(x, w, group_sizes), x, w)
    want, pull_want = jax.vjp(lambda x, w: _reference(x, w, group_sizes), x, w)
    assert_within_leaf_scale(ours, want, 1e-5)
    assert_within_leaf_scale(pull(cotangent), pull_want(cotangent), 1e-5, what='gradient')


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
def test_compiled_for_an_h100_it_is_three_triton_kernels_at_the_active_work():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax.plan import gpu_target, hlo_module

    experts, k, n, rows, tile = 8, 256, 512, 2048, 64
    devices = gpu_target.devices('h100-80gb', 1)
    whole = NamedSharding(Mesh(devices, ('x',)), PartitionSpec())
    run = _grouped(tile, interpret=False)

    def step(x, w, sizes):
        out, pull = jax.vjp(lambda x, w: run(x, w, sizes), x, w)
        return out, pull(out)

    shapes = [((rows, k), jnp.bfloat16), ((experts, k, n), jnp.bfloat16), ((experts,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in shapes]
    with gpu_target.compiling_for(devices):
        text = jax.jit(step).lower(*args).compile().as_text()
    computations, _ = hlo_module.parse_module(text)
    kernels = [
        hlo_module.pallas_kernel(i) for body in computations.values() for i in body
        if i.opcode == 'custom-call'
    ]  # fmt: skip
    assert sorted(k for k in kernels if k) == sorted(gm.KERNELS)
    active = 3 * 2 * rows * k * n  # forward, the rows' and the weights' gradients
    tiles = rows // tile + experts  # the room any routing may need
    assert hlo_module.dot_flops(text) == pytest.approx(active * tiles * tile / rows)
    assert not any(  # no dense matmul over every expert's weights
        i.opcode == 'dot' and str(experts * k) in i.type_text
        for body in computations.values()
        for i in body
    )


# tiny_moe's active widths in multiples of the kernel's smallest side (gm.SMALLEST, 16):
# its routed experts' 88 is not one, which the kernel refuses.
KERNEL_WIDTHS = dict(ffn_hidden=96, shared_ffn_hidden=512)


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
def test_the_moe_layer_compiled_for_an_h100_runs_the_kernel_at_the_active_work():
    """configs/tiny_moe.py's MoE layer (8 routed SwiGLU experts, top 2, beside a shared one)
    at widths the kernel takes (KERNEL_WIDTHS) compiled for an H100: its grouped matmuls are
    the kernel's, forward and both gradients, within 10 % of the active work (what ragged_dot
    would multiply 8 times over)."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.model import moe
    from mtnlg_jax.parallel.rules import MESH_AXES
    from mtnlg_jax.plan import gpu_target, hlo_module

    config = config_lib.load('configs/tiny_moe.py')
    config.model.moe.update(KERNEL_WIDTHS)
    config.mesh.update({axis: 1 for axis in MESH_AXES})
    config.pipeline.repeats = 1
    config.model.compute_dtype = 'bfloat16'
    cfg = config_lib.resolve(config, 1).model
    devices = gpu_target.devices('h100-80gb', 1)
    mesh = Mesh(np.array(devices).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    whole = NamedSharding(mesh, PartitionSpec())
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(params=0), grouped='pallas'))
    graphdef, state = nnx.split(layer)
    rows = 8 * cfg.seq_len

    def step(state, x, cotangent):
        forward = lambda s, x: nnx.merge(graphdef, s)(x, 0)[0]  # noqa: E731
        out, pull = jax.vjp(forward, state, x)
        return out, pull(cotangent)

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), state)
    x = jax.ShapeDtypeStruct((8, cfg.seq_len, cfg.hidden), jnp.bfloat16, sharding=whole)
    with gpu_target.compiling_for(devices), jax.set_mesh(mesh):
        text = jax.jit(step).lower(shapes, x, x).compile().as_text()
    computations, _ = hlo_module.parse_module(text)
    kernels = {hlo_module.pallas_kernel(i) for c in computations.values() for i in c} - {None}
    assert kernels == set(gm.KERNELS)
    # three matmuls an expert (SwiGLU), each forward and two gradients; the router's apart
    active = 9 * 2 * rows * cfg.moe.top_k * cfg.hidden * cfg.moe.ffn_hidden
    router = 3 * 2 * rows * cfg.hidden * cfg.moe.experts
    shared = 9 * 2 * rows * cfg.hidden * config_lib.shared_ffn_hidden(cfg)  # a dense MLP
    assert 1.0 <= (hlo_module.dot_flops(text) - router - shared) / active < 1.10


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
def test_the_ragged_exchange_compiled_for_h100s_is_ragged_all_to_all_both_ways():
    """model.moe.exchange = 'ragged' over expert 2, compiled for two H100s with its gradient:
    the rows travel by ragged-all-to-all (forward there and back, and the two transposes),
    the only all-to-alls left carry int32 counts and offsets, and the
    experts run the kernel on the receive buffer (XLA:CPU has no ragged-all-to-all: the CPU
    tests check the offsets through their emulation, test_expert_parallel.py)."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.model import moe
    from mtnlg_jax.parallel.rules import EXPERT_AXIS, MESH_AXES
    from mtnlg_jax.plan import gpu_target, hlo_module

    config = config_lib.load('configs/tiny_moe.py')
    config.model.moe.update(KERNEL_WIDTHS)
    config.mesh.update({axis: 1 for axis in MESH_AXES} | {'expert': 2})
    config.pipeline.repeats = 1
    config.model.compute_dtype = 'bfloat16'
    config.model.moe.exchange = 'ragged'
    cfg = config_lib.resolve(config, 2).model
    devices = gpu_target.devices('h100-80gb', 2)
    shape = tuple(2 if axis == EXPERT_AXIS else 1 for axis in MESH_AXES)
    mesh = Mesh(np.array(devices).reshape(shape), MESH_AXES)
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(params=0), grouped='pallas'))
    graphdef, state = nnx.split(layer)
    experts = cfg.moe.experts
    specs = jax.tree.map(
        lambda a: PartitionSpec(EXPERT_AXIS) if a.ndim == 3 and a.shape[0] == experts else
        PartitionSpec(), state)  # fmt: skip
    rows = PartitionSpec(EXPERT_AXIS)

    def step(state, x, cotangent):
        def local(state, x, cotangent):
            forward = lambda s, x: nnx.merge(graphdef, s)(x, 0)[0]  # noqa: E731
            out, pull = jax.vjp(forward, state, x)
            return out, pull(cotangent)

        return jax.shard_map(
            local, in_specs=(specs, rows, rows), out_specs=(rows, (specs, rows)),
            axis_names={EXPERT_AXIS}, check_vma=False,
        )(state, x, cotangent)  # fmt: skip

    def struct(a, spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    shapes = jax.tree.map(struct, state, specs)
    x = struct(jax.ShapeDtypeStruct((8, cfg.seq_len, cfg.hidden), jnp.bfloat16), rows)
    with gpu_target.compiling_for(devices), jax.set_mesh(mesh):
        text = jax.jit(step).lower(shapes, x, x).compile().as_text()
    computations, _ = hlo_module.parse_module(text)
    instructions = [i for c in computations.values() for i in c]
    ragged = [i for i in instructions if 'ragged-all-to-all' in i.opcode]
    padded = [i for i in instructions if i.opcode.startswith('all-to-all')]
    assert len([i for i in ragged if not i.opcode.endswith('done')]) == 4
    assert padded and all('s32' in i.type_text and 'bf16' not in i.type_text for i in padded)
    kernels = {hlo_module.pallas_kernel(i) for i in instructions} - {None}
    assert kernels == set(gm.KERNELS)
