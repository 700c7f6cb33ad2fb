"""The routed experts' products in FP8 (model.fp8): any of model/moe.py's expert matmuls,
matmul(rows, w) with w (experts, K, N), run on FP8 values.

    quantized(matmul, recipe, margin, axes)(rows, w)
        forward   rows -> e4m3, w -> e4m3; out = matmul(rows', w'), ' : scaled back
        backward  dy -> e5m2; (d rows, d w) = matmul's own VJP at (rows', w') for dy'

Scales: tensorwise and delayed (the experts take current scaling: delayed's history keeps the
block's dense sites, model/fp8_sites.py) one for the rows, one for all of w, one for dy, each
from its amax: the rows' over the rows this rank multiplies, and where an exchange over
`axes` (mesh.expert, with tensor under parallel folding) sends rows to their experts, the max
over the exchange's ranks, so every expert scales its rows alike whatever rank holds it (the
rows of the exchange's micro-batches: one device's micro-batch when it holds them all); w's
over every expert (a max over `axes`, where w is split by expert). Blockwise: the rows and dy
by 1 x 128 tiles, each expert's w by 128 x 128 blocks (model/fp8.py's), local, no max.

The quantized values pass an optimization barrier and are scaled back in the compute dtype
before the matmul (exact: power-of-two scales), the form in which XLA:GPU rewrites a batched
product into a cuBLASLt FP8 GEMM (the padded exchange's `xne,xef->xnf`, tensorwise and
delayed: tests/test_fp8.py); the grouped kernels (the Pallas kernel, ragged_dot, the CPU's
tiles) multiply the same values at the compute dtype's rate. What the backward keeps is
matmul's own residuals, the values scaled back (the compute dtype's bytes, not FP8's as the
block's dense sites keep).
"""

import functools

import jax
import jax.numpy as jnp

from mtnlg_jax.model import fp8


def quantized(matmul, recipe, margin=0, axes=()):
    """matmul(rows, w) on FP8 values under `recipe` (the module docstring); `axes`: the
    manual mesh axes the rows are exchanged over and w is split over by expert."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def product(rows, w):
        rows = _on_grid(rows, recipe, margin, axes, False)
        out = matmul(rows, _on_grid(w, recipe, margin, axes, True))
        return _gradient_on_grid(out, recipe, margin, axes)

    return product


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _on_grid(v, recipe, margin, axes, weights):
    """v's e4m3 values scaled back (rows, or w (experts, K, N) if `weights`); its gradient
    passes through as it comes (matmul's own VJP multiplies these values)."""
    kept = (
        _weights(v, recipe, margin, axes) if weights else _rows(v, fp8.E4M3, recipe, margin, axes)
    )
    kept = jax.lax.optimization_barrier(jax.lax.stop_gradient(kept))
    return _scaled_back(*kept, recipe, v.dtype, weights)


def _on_grid_fwd(v, recipe, margin, axes, weights):
    return _on_grid(v, recipe, margin, axes, weights), None


def _on_grid_bwd(recipe, margin, axes, weights, _, g):
    return (g,)


_on_grid.defvjp(_on_grid_fwd, _on_grid_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gradient_on_grid(out, recipe, margin, axes):
    """out as it is; its gradient dy on e5m2 values, scaled back."""
    return out


def _gradient_fwd(out, recipe, margin, axes):
    return out, None


def _gradient_bwd(recipe, margin, axes, _, dy):
    kept = jax.lax.optimization_barrier(_rows(dy, fp8.E5M2, recipe, margin, axes))
    return (_scaled_back(*kept, recipe, dy.dtype, False),)


_gradient_on_grid.defvjp(_gradient_fwd, _gradient_bwd)


def _rows(v, dtype, recipe, margin, axes):
    """(q, scale) of rows (..., K): by 1 x 128 tiles under blockwise ((..., K / B, B) and
    (..., K / B, 1)), else one scale, the max over `axes`."""
    if recipe == 'blockwise':
        q, scale = fp8._tiles(v.reshape(-1, v.shape[-1]), dtype, margin)
        return q.reshape(*v.shape[:-1], *q.shape[1:]), scale.reshape(*v.shape[:-1], -1, 1)
    amax = fp8.amax(v)
    scale = fp8.scale_of(jax.lax.pmax(amax, axes) if axes else amax, dtype, margin)
    return fp8.quantize(v, dtype, scale), scale


def _weights(w, recipe, margin, axes):
    """(q, scale) of w (experts, K, N): each expert's 128 x 128 blocks under blockwise, else
    one scale over every expert."""
    if recipe == 'blockwise':
        return jax.vmap(lambda e: fp8._blocks(e, margin))(w)
    return _rows(w, fp8.E4M3, recipe, margin, axes)


def _scaled_back(q, scale, recipe, dtype, weights):
    """q / scale in `dtype`, in the shape it was quantized from: as fp8._dequantized (the
    form XLA:GPU's GEMM rewriter takes) for one scale; tiles put back in rows, blocks in
    each expert's (K, N), under blockwise."""
    if recipe != 'blockwise':
        return fp8._dequantized(q, scale, dtype)
    v = q.astype(jnp.float32) / scale
    if weights:
        experts, kb, b, nb, bn = q.shape
        return v.reshape(experts, kb * b, nb * bn).astype(dtype)
    return v.reshape(*q.shape[:-2], -1).astype(dtype)
