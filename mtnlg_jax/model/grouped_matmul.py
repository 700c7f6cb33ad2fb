"""A grouped matmul in Pallas (Triton on NVIDIA GPUs): each expert's rows times that expert's
weights, reading the weights where they lie and multiplying only the rows there are.

    layout = tile_layout(group_sizes, rows, tile)      where each sorted row goes
    x = to_tiles(sorted_rows, layout)                  (tiles x tile, K): each tile one expert's
    y = grouped_matmul(x, weights, layout)             (tiles x tile, N)
    out = from_tiles(y, layout)                        (rows, N), the sorted rows' order

    sorted rows   e0 e0 e0 e1 e1 e2 e2 e2 e2 e2      group sizes (3, 2, 5), tile 4
    tiles         [e0 e0 e0 0 ][e1 e1 0 0 ][e2 e2 e2 e2][e2 0 0 0 ][unused ...]
                  each tile: rows (tile, K) @ weights[its expert] (K, N), one program per
                  (tile, N block); an unused tile runs nothing

Why by hand: `jax.lax.ragged_dot` compiles to one matmul over every expert with the other
experts' rows masked, on XLA:CPU and XLA:GPU alike (experts x the active work and a
(rows, experts x K) temporary: docs/benchmarks.md, "Mixture of experts"), and a scan over
tiles that slices each tile's weights out of the stack has XLA:GPU copy them per tile. Here
each program indexes its expert's weights by pointer, as a grouped GEMM does.

    forward   grid (tile, N block): out = x_tile @ w[e]
    d rows    grid (tile, K block): dx = dy_tile @ w[e]^T
    d weights grid (expert, K block, N block): dw[e] = sum over e's tiles of x_t^T @ dy_t

The tiles hold at most rows + experts x (tile - 1) real rows: the padding is at most one
tile an expert. `interpret=True` runs the same kernels on any backend (the tests, on CPU).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The kernels' names (they name the compiled custom calls), for the planner's FLOP count:
# each is 2 x (tiles x tile) x K x N multiply-adds' worth of work at most.
FORWARD, ROWS, WEIGHTS = 'grouped_matmul', 'grouped_matmul_drows', 'grouped_matmul_dweights'
KERNELS = (FORWARD, ROWS, WEIGHTS)
BLOCK = 64  # K and N blocks of a program, at most
SMALLEST = 16  # Triton's smallest matmul side


class Layout(NamedTuple):
    """Where each of `rows` sorted rows sits in tiles of `tile` rows (static sizes, traced
    contents): `index` (rows,) its place in the tiles; `tile_expert` (tiles,) each tile's
    expert (the last expert for unused tiles); `used` () how many tiles hold rows;
    `first_tile`, `tile_count` (experts,) each expert's tiles."""

    index: jax.Array
    tile_expert: jax.Array
    used: jax.Array
    first_tile: jax.Array
    tile_count: jax.Array
    tile: int


def tile_layout(group_sizes, rows, tile):
    """The Layout of `rows` rows sorted by expert, group_sizes (experts,) int32 rows each:
    every expert's rows padded to whole tiles; room for the most tiles any routing needs.
    Rows past the groups (an MoE's dropped choices, sorted last) go in no tile."""
    experts = group_sizes.shape[0]
    tiles = -(-rows // tile) + experts
    counts = -(-group_sizes // tile)
    first = jnp.cumsum(counts) - counts
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(rows), side='right')
    expert = jnp.minimum(group, experts - 1)
    position = jnp.arange(rows) - (ends - group_sizes)[expert]
    inside = first[expert] * tile + position
    index = jnp.where(group < experts, inside, tiles * tile).astype(jnp.int32)
    tile_expert = jnp.searchsorted(jnp.cumsum(counts), jnp.arange(tiles), side='right')
    tile_expert = jnp.minimum(tile_expert, experts - 1).astype(jnp.int32)
    return Layout(
        index, tile_expert, counts.sum().astype(jnp.int32), first.astype(jnp.int32),
        counts.astype(jnp.int32), tile,
    )  # fmt: skip


def to_tiles(rows, layout):
    """(tiles x tile, K) of rows (rows, K) sorted by expert; padding rows zero."""
    tiles = layout.tile_expert.shape[0]
    out = jnp.zeros((tiles * layout.tile, rows.shape[1]), rows.dtype)
    return out.at[layout.index].set(rows, mode='drop')


def from_tiles(tiled, layout):
    """The sorted rows' (rows, N) of tiled (tiles x tile, N); 0 for a row in no tile."""
    return jnp.take(tiled, layout.index, axis=0, mode='fill', fill_value=0)


def grouped_matmul(x, weights, layout, *, interpret=False):
    """x (tiles x tile, K) @ weights[tile's expert] (experts, K, N) -> (tiles x tile, N) in x's
    dtype, accumulated in fp32; differentiable in x and weights."""
    meta = (layout.tile_expert, layout.used, layout.first_tile, layout.tile_count)
    return _grouped(x, weights, meta, _Static(layout.tile, bool(interpret)))


class _Static(NamedTuple):
    tile: int
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, weights, meta, static):
    return _forward(x, weights, meta, static)


def _grouped_fwd(x, weights, meta, static):
    return _forward(x, weights, meta, static), (x, weights, meta)


def _grouped_bwd(static, saved, d_out):
    x, weights, meta = saved
    d_x = _rows_gradient(d_out, weights, meta, static)
    d_w = _weights_gradient(x, d_out, weights, meta, static)
    zeros = jax.tree.map(lambda m: jnp.zeros(m.shape, jax.dtypes.float0), meta)
    return d_x, d_w, zeros


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def takes(*sizes):
    """Whether the kernel takes matmul sides of these sizes (multiples of SMALLEST)."""
    return all(size % SMALLEST == 0 for size in sizes)


def _block(size):
    """A K or N block: the largest power of two up to BLOCK that divides the dimension."""
    block = BLOCK
    while size % block:
        block //= 2
    if block < SMALLEST:
        raise ValueError(f'grouped_matmul: a dimension of {size} is not a multiple of {SMALLEST}')
    return block


def _scalar_spec(grid_axis):
    return pl.BlockSpec((None, 1), lambda *ids: (ids[grid_axis], 0))


def _tile_times_expert(x_ref, w_ref, expert_ref, used_ref, o_ref, *, transpose):
    """One (tile, block) program: o = x_tile @ w[e] (or w[e]^T), over the contracted blocks;
    an unused tile writes zeros."""
    tile, contracted = x_ref.shape
    expert = expert_ref[0]
    width = o_ref.shape[1]
    step = _block(contracted)

    @pl.when(pl.program_id(0) < used_ref[0])
    def _():
        def body(k, acc):
            a = x_ref[:, pl.ds(k * step, step)]
            if transpose:  # w[e] (K, N) read as (N block, K block), transposed
                b = w_ref[expert, :, pl.ds(k * step, step)].T
            else:
                b = w_ref[expert, pl.ds(k * step, step), :]
            return acc + plgpu.dot(a, b)

        acc = jax.lax.fori_loop(0, contracted // step, body, jnp.zeros((tile, width), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(pl.program_id(0) >= used_ref[0])
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _tiled_call(x, weights, meta, static, transpose, name):
    """x @ w[e] per tile (transpose: x @ w[e]^T, the rows' gradient)."""
    tile_expert, used = meta[0], meta[1]
    rows, contracted = x.shape
    width = weights.shape[1] if transpose else weights.shape[2]
    block = _block(width)
    if transpose:  # w (E, K, N): a program's (K block) rows of every expert, all of N
        w_spec = pl.BlockSpec((weights.shape[0], block, weights.shape[2]), lambda i, j: (0, j, 0))
    else:
        w_spec = pl.BlockSpec((weights.shape[0], contracted, block), lambda i, j: (0, 0, j))
    return pl.pallas_call(
        functools.partial(_tile_times_expert, transpose=transpose),
        grid=(rows // static.tile, width // block),
        in_specs=[
            pl.BlockSpec((static.tile, contracted), lambda i, j: (i, 0)),
            w_spec,
            _scalar_spec(0),
            pl.BlockSpec((1,), lambda i, j: (0,)),
        ],
        out_specs=pl.BlockSpec((static.tile, block), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, width), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=static.interpret,
        name=name,
    )(x, weights, tile_expert[:, None], used[None])


def _forward(x, weights, meta, static):
    return _tiled_call(x, weights, meta, static, False, FORWARD)


def _rows_gradient(d_out, weights, meta, static):
    return _tiled_call(d_out, weights, meta, static, True, ROWS)


def _expert_weights_kernel(x_ref, dy_ref, first_ref, count_ref, o_ref, *, tile):
    """dw[e] (K block, N block) = sum over expert e's tiles of x_t^T @ dy_t."""

    def body(t, acc):
        rows = pl.ds((first_ref[0] + t) * tile, tile)
        return acc + plgpu.dot(x_ref[rows, :].T, dy_ref[rows, :])

    acc = jax.lax.fori_loop(0, count_ref[0], body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _weights_gradient(x, d_out, weights, meta, static):
    experts, contracted, width = weights.shape
    k_block, n_block = _block(contracted), _block(width)
    rows = x.shape[0]
    return pl.pallas_call(
        functools.partial(_expert_weights_kernel, tile=static.tile),
        grid=(experts, contracted // k_block, width // n_block),
        in_specs=[
            pl.BlockSpec((rows, k_block), lambda e, a, b: (0, a)),
            pl.BlockSpec((rows, n_block), lambda e, a, b: (0, b)),
            _scalar_spec(0),
            _scalar_spec(0),
        ],
        out_specs=pl.BlockSpec((None, k_block, n_block), lambda e, a, b: (e, a, b)),
        out_shape=jax.ShapeDtypeStruct(weights.shape, weights.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=static.interpret,
        name=WEIGHTS,
    )(x, d_out, meta[2][:, None], meta[3][:, None])
