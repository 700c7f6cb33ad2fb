"""Matmuls in FP8: the inputs scaled into FP8's range, multiplied, the product scaled back.

    y = x @ w          x (..., K) activations, w (K, N) weights; fp32 accumulation
    forward            x, w -> e4m3 (3 mantissa bits, max 448)
    backward           dy -> e5m2 (2 mantissa bits, max 57344: gradients span more range)
                       dx = dy @ w^T, dw = x^T @ dy, from the same quantized x and w

A scale maps a tensor's largest magnitude (its amax) into the top binade of the format (a power
of two: amax x scale in (max / 2, max]), so the values use the format's range:
q = saturate(v x scale), v ~ q / scale. Recipes:

    tensorwise   one scale a tensor, from this step's amax (current scaling)
    delayed      x's and w's scales from amax values of earlier steps, passed in (the
                 caller's history, e.g. a buffer: model/buffers.py); dy's current
    blockwise    DeepSeek-V3's: x and dy by 1 x 128 tiles (a scale per row and 128 columns
                 of K), w by 128 x 128 blocks; each K block's product scaled back before
                 the blocks are summed in fp32 (here: the GEMM of the values scaled back)

Tensorwise and delayed scales are powers of two, so that a dequantized value (q / scale, in
the compute dtype) is exact. Their products are written in the one form XLA:GPU's GEMM
rewriter turns into a cuBLASLt FP8 GEMM with the scales as operands (`__cublas$lt$matmul$f8`,
jaxlib 0.10.2, tests/test_fp8.py): dot(convert(q_a) x broadcast(1 / s_a), convert(q_b) x
broadcast(1 / s_b)), the converts and the multiplies in the compute dtype, the dot's result in
it too. The dot's result is then the scaled product itself, so under tensor parallelism its
partial sums are reduced (reduce-scattered) in the compute dtype, as the bf16 step's are; a
scaling after the dot would sit between the all-reduce and its slice. The rewrite only
happens with XLA:GPU's Triton GEMMs off (COMPILER_OPTIONS: GemmFusion otherwise takes the dot
first, as a bf16 product of the dequantized operands). Blockwise's products are GEMMs in the
compute dtype of its tiles and blocks scaled back (_blockwise_product says why). The input
gradient and the weight gradient are separate products, so a schedule may run them apart.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPES = ('tensorwise', 'delayed', 'blockwise')
BLOCK = 128  # blockwise: columns of an activation tile, the side of a weight block
# What a product keeps for its backward, by name (model.remat = selective keeps the first):
# the quantized input and both scales; the quantized weight; the quantized input of a product
# whose x the backward recomputes anyway (matmul's keep_input=False: requantized from it).
SAVED_NAMES = ('fp8_input', 'fp8_weight', 'fp8_input_again')
# XLA options of a program with tensorwise or delayed FP8 products (jax.jit's
# compiler_options; XLA:CPU ignores them): GEMMs through cuBLASLt, where the FP8 rewrite is
# (the module docstring). Blockwise's products are not of that form: none.
COMPILER_OPTIONS = {'xla_gpu_enable_triton_gemm': False}


def compiler_options(recipe):
    """jax.jit's compiler_options for a program with `recipe`'s products ('none': bf16)."""
    return dict(COMPILER_OPTIONS) if recipe in ('tensorwise', 'delayed') else {}


def largest(dtype):
    return float(jnp.finfo(dtype).max)


def scale_of(amax, dtype, margin=0):
    """The factor mapping amax into the format's top binade below its largest value /
    2^margin, a power of two (q / scale is then exact in any float type: the GEMM's
    dequantization); 1 where amax is 0."""
    amax = jnp.asarray(amax, jnp.float32)
    scale = jnp.exp2(jnp.floor(jnp.log2(largest(dtype) / (amax * 2.0**margin))))
    return jnp.where(amax > 0, scale, 1.0)


def quantize(v, dtype, scale):
    """v x scale, saturated to the format's range, in the format."""
    limit = largest(dtype)
    return jnp.clip(v.astype(jnp.float32) * scale, -limit, limit).astype(dtype)


def amax(v):
    """The largest |v|, of an array or of a tuple of slots (all of them)."""
    if isinstance(v, tuple):
        return functools.reduce(jnp.maximum, map(amax, v))
    return jnp.max(jnp.abs(v)).astype(jnp.float32)


def matmul(
    x, w, recipe='tensorwise', scales=None, margin=0, quantized=None, gather=None, gather_dy=None,
    keep_input=True, x_quantized=None,
):  # fmt: skip
    """x (..., K) @ w (K, *N) in FP8 under `recipe` (RECIPES), in x's dtype: (..., *N). scales:
    delayed's (x scale, w scale), from earlier steps' amax values (scale_of). N may be several
    dimensions (a fused kernel's slots, heads, head_dim), left unfolded: one product, one
    input-gradient product; blockwise takes one N dimension (its 128 x 128 weight blocks).
    w may be a tuple of slots, each (K, *N), multiplied as one weight (K, slots, *N) (e.g.
    SwiGLU's gate and in kernels): one scale over them all, and stacked only once quantized
    (the stack written in FP8, inside the quantization's kernel); their gradients a tuple.
    quantized: w already quantized (tensorwise and delayed, once a step: model/fp8_sites.py),
    (q with K last (*N, K) as the slots stack it, the forward GEMM's operand, its scale); the
    input gradient's GEMM contracts its N (XLA transposes it for cuBLASLt as the GEMM runs); w
    then only says the gradient's type, which goes to w as without it.
    gather (tensorwise and delayed): a function applied to the quantized x before each product
    that takes it (the forward's, the weight gradient's): x may come split along its rows (a
    sequence-parallel shard) and be gathered in FP8, half the bytes of the compute dtype, the
    quantized x kept for the backward then the shard; None: x's products take it as it comes.
    gather_dy: the same for the product's gradient dy, quantized (e5m2) before its gradients'
    products take it (a row-parallel product's dy arrives a sequence shard). keep_input False:
    the quantized x is named SAVED_NAMES[2], which selective recompute does not keep (its
    scale it keeps), so the backward quantizes x again from x recomputed: for a product whose
    x the backward recomputes anyway (a row-parallel site's, whole along the sequence).
    x_quantized (tensorwise and delayed): x quantized by quantized_input, shared by the
    products of one x (attention's q and kv): x is then not quantized again, and the backward
    of each keeps that one q, not a copy of its own; x only carries the input's gradient."""
    if isinstance(w, list):
        w = tuple(w)
    if isinstance(w, tuple) and recipe == 'blockwise':
        raise ValueError('blockwise FP8 multiplies one (K, N) weight, not slots')
    if recipe not in RECIPES:
        raise ValueError(f'FP8 recipe {recipe!r}: one of {RECIPES}')
    if recipe == 'delayed' and scales is None:
        raise ValueError('the delayed FP8 recipe needs the scales of x and w')
    if quantized is not None and recipe == 'blockwise':
        raise ValueError('a weight quantized ahead is tensorwise or delayed, not blockwise')
    if x_quantized is not None and (recipe == 'blockwise' or not keep_input):
        raise ValueError('a quantized x handed in is tensorwise or delayed, and kept')
    if recipe == 'blockwise' and w.ndim != 2:
        raise ValueError(f'blockwise FP8 multiplies a (K, N) weight, got {w.shape}')
    scales = (jnp.float32(1.0), jnp.float32(1.0)) if scales is None else scales
    if (gather, gather_dy) != (None, None) and recipe == 'blockwise':
        raise ValueError('blockwise FP8 takes x and dy whole: no gather')
    gathers = (gather, gather_dy, SAVED_NAMES[0 if keep_input else 2])
    if recipe != 'blockwise':  # x's leading dimensions kept: their shardings reach the dots
        return _matmul(x, w, scales, quantized, x_quantized, recipe, margin, gathers)
    flat = x.reshape(-1, x.shape[-1])
    out = _matmul(flat, w, scales, None, None, recipe, margin, (None, None, gathers[2]))
    return out.reshape(*x.shape[:-1], w.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _matmul(x, w, scales, quantized, given, recipe, margin, gathers):
    return _forward(x, w, scales, quantized, given, recipe, margin, *gathers[::2])[0]


def _forward(x, w, scales, quantized, given, recipe, margin, gather=None, x_name=None):
    if recipe == 'blockwise':
        qx, sx = _tiles(x, E4M3, margin)
        qw, sw = _blocks(w, margin)
        return _blockwise_product(qx, sx, qw, sw, x.dtype), (qx, sx, qw, sw)
    sx = scales[0] if recipe == 'delayed' else None
    qx, sx, kept = given if given is not None else quantized_input(x, sx, margin, x_name)
    if quantized is not None:
        return _forward_quantized(qx, sx, kept, quantized, x.dtype, gather)
    sw = scales[1] if recipe == 'delayed' else scale_of(amax(w), E4M3, margin)
    if isinstance(w, tuple):  # slots: quantized, then stacked after K
        qw = jnp.stack([quantize(slot, E4M3, sw) for slot in w], 1)
    else:
        qw = quantize(w, E4M3, sw)
    saved = (*kept, checkpoint_name(qw, SAVED_NAMES[1]), checkpoint_name(sw, SAVED_NAMES[0]))
    product = _product(_gathered(gather, qx), sx, qw, sw, x.dtype, ((qx.ndim - 1,), (0,)))
    return product, saved


def quantized_input(x, scale=None, margin=0, name=None):
    """x quantized in e4m3 by `scale` (delayed's; None: its amax's): (q, scale, the two named
    for selective recompute, `name` (SAVED_NAMES[0] by default) and SAVED_NAMES[0]). The
    products take the unnamed pair and the backward the named one: jax.checkpoint rounds a
    kept value that its forward also uses to its type's bits (reduce_precision), which reads
    e4m3fn as if it had infinities: what lies over 240 becomes NaN where XLA does not drop
    the rounding (one op at a time). No gradient flows through them (matmul's x carries it)."""
    x = jax.lax.stop_gradient(x)
    sx = scale_of(amax(x), E4M3, margin) if scale is None else jax.lax.stop_gradient(scale)
    qx = quantize(x, E4M3, sx)
    kept = checkpoint_name(qx, name or SAVED_NAMES[0]), checkpoint_name(sx, SAVED_NAMES[0])
    return qx, sx, kept


def _forward_quantized(qx, sx, kept, quantized, dtype, gather=None):
    """_forward's product with w quantized ahead: the quantized x (and `kept`, its named pair,
    quantized_input's) times w's copy with K last (cuBLASLt's FP8 GEMM wants both operands'
    contracted dimension innermost)."""
    qw_k_last, sw = quantized
    contract = ((qx.ndim - 1,), (qw_k_last.ndim - 1,))
    product = _product(_gathered(gather, qx), sx, qw_k_last, sw, dtype, contract)
    return product, (*kept, qw_k_last, sw)


def _gathered(gather, q):
    """A quantized x or dy as its products take it (matmul's gather, gather_dy)."""
    return q if gather is None else gather(q)


def _matmul_fwd(x, w, scales, quantized, given, recipe, margin, gathers):
    out, saved = _forward(x, w, scales, quantized, given, recipe, margin, *gathers[::2])
    like = jax.tree.map(lambda v: jnp.zeros((0,), v.dtype), (x, w))  # the gradients' types
    handed = None if given is None else ()  # whether x came quantized: in the tree's structure
    return out, (saved, scales, quantized, handed, like)


def _matmul_bwd(recipe, margin, gathers, residuals, dy):
    (qx, sx, qw, sw), scales, quantized, handed, (x_like, w_like) = residuals
    slots = len(w_like) if isinstance(w_like, tuple) else 0
    x_dtype, w_dtype = x_like.dtype, jax.tree.leaves(w_like)[0].dtype
    zero_scales = jax.tree.map(jnp.zeros_like, scales)
    zero_quantized = jax.tree.map(jnp.zeros_like, quantized)  # no gradient: w takes dW
    if recipe == 'blockwise':
        # the gradients scale dy's e5m2 values back to bf16: a convert there and back that
        # XLA:GPU's fp-conversion simplification would drop (dy at bf16's precision) unless
        # the e5m2 tiles are a value of their own
        qdy, sdy = jax.lax.optimization_barrier(_tiles(dy, E5M2, margin))
        dx = _blockwise_rows_gradient(qdy, sdy, qw, sw, x_dtype)
        dw = _blockwise_weights_gradient(qx, sx, qdy, sdy, w_dtype)
        return dx, dw, zero_scales, None, None
    sdy = scale_of(amax(dy), E5M2, margin)
    qdy = _gathered(gathers[1], quantize(dy, E5M2, sdy))
    n, lead = qw.ndim - 1, tuple(range(qx.ndim - 1))
    n_of_dy = tuple(range(qdy.ndim - n, qdy.ndim))
    n_of_w = tuple(range(n)) if quantized is not None else tuple(range(1, qw.ndim))  # K last?
    dx = _product(qdy, sdy, qw, sw, x_dtype, (n_of_dy, n_of_w))  # the input's gradient
    zero = jnp.zeros_like(qx), jnp.zeros_like(sx)
    zero_given = None if handed is None else (*zero, zero)  # quantized_input's structure
    qx = _gathered(gathers[0], qx)  # kept as it came (a shard), gathered again for dW
    dw = _product(qx, sx, qdy, sdy, w_dtype, (lead, lead))  # the weights' gradient, apart
    if slots:
        dw = tuple(dw[:, i] for i in range(slots))
    return dx, dw, zero_scales, zero_quantized, zero_given


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _product(qa, sa, qb, sb, dtype, contract):
    """(qa / sa) . (qb / sb) in `dtype`, contracting the `contract` dimensions: each operand
    dequantized right before the dot (the form XLA:GPU rewrites into one FP8 GEMM, the scales
    its operands and the accumulation fp32: the module docstring)."""
    a, b = _dequantized(qa, sa, dtype), _dequantized(qb, sb, dtype)
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=dtype)


def _dequantized(q, scale, dtype):
    """q / scale in `dtype`: exact for power-of-two scales (scale_of)."""
    return q.astype(dtype) * (1.0 / scale).astype(dtype)


def _tiles(v, dtype, margin):
    """v (M, K) quantized by 1 x BLOCK tiles: (q (M, K / B, B), scales (M, K / B, 1))."""
    rows, cols = v.shape
    tiled = v.reshape(rows, cols // _block(cols), _block(cols)).astype(jnp.float32)
    scale = scale_of(jnp.max(jnp.abs(tiled), axis=-1, keepdims=True), dtype, margin)
    return quantize(tiled, dtype, scale), scale


def _blocks(w, margin):
    """w (K, N) quantized by BLOCK x BLOCK blocks: (q (K / B, B, N / B, B), scales
    (K / B, 1, N / B, 1))."""
    k, n = w.shape
    bk, bn = _block(k), _block(n)
    blocked = w.reshape(k // bk, bk, n // bn, bn).astype(jnp.float32)
    scale = scale_of(jnp.max(jnp.abs(blocked), axis=(1, 3), keepdims=True), E4M3, margin)
    return quantize(blocked, E4M3, scale), scale


def _block(size):
    if size % BLOCK and size > BLOCK:
        raise ValueError(f'blockwise FP8: a dimension of {size} is not a multiple of {BLOCK}')
    return min(size, BLOCK)


def _blockwise_product(qx, sx, qw, sw, dtype):
    """sum over K blocks of (qx_k @ qw_k) / (sx_k sw_k), as one GEMM in `dtype` of the tiles
    and blocks scaled back (exact: e4m3 values times power-of-two scales are bf16 values), its
    accumulation fp32. DeepSeek-V3's kernel scales each block's partial sum inside its loop;
    XLA:GPU has no GEMM with per-tile scales on Hopper, and a batched FP8 product over the K
    blocks with the (K / B, M, N) fp32 partials summed outside ran 4.2 x bf16's time on an
    H200 (docs/benchmarks.md, "FP8 on the device"). The tiles go through an optimization
    barrier: a convert to e4m3 and back that XLA can see, its fp-conversion simplification
    drops (the values then at bf16's precision, as dy's e5m2 in _matmul_bwd)."""
    qx, sx, qw, sw = jax.lax.optimization_barrier((qx, sx, qw, sw))
    x = (qx.astype(jnp.float32) / sx).reshape(qx.shape[0], -1).astype(dtype)
    w = (qw.astype(jnp.float32) / sw).reshape(qw.shape[0] * qw.shape[1], -1).astype(dtype)
    return jnp.dot(x, w, preferred_element_type=dtype)


def _blockwise_rows_gradient(qdy, sdy, qw, sw, dtype):
    """dx (M, K) = dy (M, N) @ w^T, dy by 1 x B tiles over N, w by its blocks: both scaled
    back before one GEMM over all of N in `dtype` (its accumulation fp32 on every backend: a
    16-bit dot with an fp32 result is one XLA:CPU's runtime cannot run outside a fusion)."""
    dy = (qdy.astype(jnp.float32) / sdy).astype(dtype)  # (M, Nb, B)
    w = (qw.astype(jnp.float32) / sw).astype(dtype)  # (Kb, B, Nb, B)
    out = jnp.einsum('mnc,kbnc->mkb', dy, w, preferred_element_type=dtype)
    return out.reshape(out.shape[0], -1)


def _blockwise_weights_gradient(qx, sx, qdy, sdy, dtype):
    """dw (K, N) = x^T @ dy, both by their 1 x B tiles (their rows are the contracted ones),
    scaled back before one GEMM in `dtype` as _blockwise_rows_gradient's."""
    x = (qx.astype(jnp.float32) / sx).reshape(qx.shape[0], -1).astype(dtype)
    dy = (qdy.astype(jnp.float32) / sdy).reshape(qdy.shape[0], -1).astype(dtype)
    return jnp.dot(x.T, dy, preferred_element_type=dtype)
