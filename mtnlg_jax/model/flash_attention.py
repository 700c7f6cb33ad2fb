"""Causal flash attention with attention dropout, in Pallas (Triton on NVIDIA GPUs).

Why by hand: cuDNN's flash attention (jax.nn.dot_product_attention) takes head dimensions of at
most 128 before Hopper (MT-NLG's is 160) and draws its dropout masks from a seed fixed when the
step is compiled; JAX's own Pallas kernel (jax.experimental.pallas.ops.gpu.attention) has no
dropout. This one pads the head dimension to a power of two inside the kernel (the padded
lanes are masked) and draws each dropout bit from a counter hash of

    (seed of the sequence and head, query position, key position)

so a mask depends on nothing but the sequence's own dropout key, the site and the global head:
the same whatever the mesh layout, micro-batching or pipeline schedule (the promise the plain
path keeps with jax.random, parallel/rules.py's per-sequence keys). The two paths draw
different masks from the same keys; each is reproducible.

    forward   grid (query block, batch, head): one query block against the visible key
              blocks with an online softmax; keeps the log-sum-exp per query
    backward  grid (batch, head, block): dK, dV of a key block over the query blocks that see
              it, then dQ of a query block over the key blocks it sees; the scores are
              recomputed from q, k and the log-sum-exp (as FlashAttention does), never stored

With dropout, P' = keep * P / (1 - rate) is what multiplies V, the softmax normaliser is P's,
and dS = P * (keep * dP' / (1 - rate) - rowsum(dO * O)).

`interpret=True` runs the same kernels on any backend (the tests, on CPU).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASKED = -1e30  # finite: a fully masked padding row never produces NaN
# The kernels' names (they name the compiled custom calls) and the matmuls each runs over the
# scores, for the planner's FLOP count: QK^T and PV forward; QK^T again, dV, dP, dQ and dK
# backward (the scores are recomputed, not stored).
FORWARD, BACKWARD = 'flash_attention_forward', 'flash_attention_backward'
KERNEL_MATMULS = {FORWARD: 2, BACKWARD: 5}
MAX_HEAD_DIM = 256  # padded: one (block, 256) tile of q, k, v each fits an A100's shared memory


def _fmix32(x):
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with p ~ 1/2."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def keep_mask(seed, query_pos, key_pos, num_keys, rate):
    """Which (query, key) probabilities survive dropout at `rate`: a (len(query_pos),
    len(key_pos)) bool from the uint32 `seed` of one sequence and head. Runs inside the kernels
    and, for the tests, outside them."""
    counter = query_pos[:, None].astype(jnp.uint32) * jnp.uint32(num_keys) + key_pos[
        None, :
    ].astype(jnp.uint32)
    bits = _fmix32(_fmix32(counter ^ seed) + seed)
    return bits >= jnp.uint32(min(int(rate * 2.0**32), 2**32 - 1))


def head_seeds(row_keys, site, heads):
    """(batch, heads) uint32 dropout seeds from one PRNG key per sequence (batch,) and the
    dropout site: the global head is part of the draw, so a head's mask is the same on
    whichever device holds it."""
    return jax.vmap(lambda key: jax.random.bits(jax.random.fold_in(key, site), (heads,)))(
        row_keys
    ).astype(jnp.uint32)


def _block_sizes(head_dim_padded, seq):
    """(forward block, backward block): what fits an A100's shared memory at this width."""
    forward = 64 if head_dim_padded > 128 else 128
    return min(forward, seq), min(32, seq)


def refusal(seq, head_dim):
    """Why the kernel cannot take this shape (one phrase), or None."""
    width = _padded(head_dim)
    if width > MAX_HEAD_DIM:
        return f'head dim {head_dim} (at most {MAX_HEAD_DIM})'
    if any(seq % block for block in _block_sizes(width, seq)):
        return f'sequence length {seq} (a multiple of {max(_block_sizes(width, seq))})'
    return None


def _scores(q, k, query_pos, key_pos, scale):
    """Scaled causal scores of a query block against a key block, fp32."""
    s = plgpu.dot(q, k.T) * scale
    return jnp.where(query_pos[:, None] >= key_pos[None, :], s, _MASKED)


def _dropped(p, seed_ref, query_pos, key_pos, num_keys, rate):
    """p with dropout applied (inverted), or p when rate is 0."""
    if rate == 0.0:
        return p
    keep = keep_mask(seed_ref[0], query_pos, key_pos, num_keys, rate)
    return jnp.where(keep, p * (1.0 / (1.0 - rate)), 0.0)


def _forward_kernel(q_ref, k_ref, v_ref, seed_ref, o_ref, lse_ref, *, rate, block_k, head_dim):
    block_q, width = q_ref.shape
    seq = k_ref.shape[0]
    start_q = pl.program_id(0)
    lanes = (jnp.arange(width) < head_dim)[None, :]
    q = plgpu.load(q_ref, mask=lanes, other=0.0)
    query_pos = start_q * block_q + jnp.arange(block_q)
    scale = 1.0 / math.sqrt(head_dim)

    def over_keys(start_k, carry):
        o, row_max, row_sum = carry
        block = pl.ds(start_k * block_k, block_k)
        key_pos = start_k * block_k + jnp.arange(block_k)
        k = plgpu.load(k_ref.at[block, :], mask=lanes, other=0.0)
        s = _scores(q, k, query_pos, key_pos, scale)
        m_next = jnp.maximum(row_max, s.max(axis=-1))
        p = jnp.exp(s - m_next[:, None])
        correction = jnp.exp(row_max - m_next)
        v = plgpu.load(v_ref.at[block, :], mask=lanes, other=0.0)
        p_kept = _dropped(p, seed_ref, query_pos, key_pos, seq, rate)
        o = correction[:, None] * o + plgpu.dot(p_kept.astype(v.dtype), v)
        return o, m_next, correction * row_sum + p.sum(axis=-1)

    visible_blocks = jax.lax.div(block_q * (start_q + 1) + block_k - 1, block_k)
    o, row_max, row_sum = jax.lax.fori_loop(
        0,
        visible_blocks,
        over_keys,
        (
            jnp.zeros((block_q, width), jnp.float32),
            jnp.full((block_q,), _MASKED, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        ),
    )
    lse_ref[...] = row_max + jnp.log(row_sum)
    plgpu.store(o_ref, (o / row_sum[:, None]).astype(o_ref.dtype), mask=lanes)


def _backward_kernel(
    q_ref, k_ref, v_ref, seed_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
    *, rate, block, head_dim,
):  # fmt: skip
    seq, width = q_ref.shape
    lanes = (jnp.arange(width) < head_dim)[None, :]
    scale = 1.0 / math.sqrt(head_dim)
    index = pl.program_id(2)

    def gradient_of_scores(q, k, v, do, lse, delta, query_pos, key_pos):
        """(dS, P') of one (query block, key block): dS already scaled by the softmax scale."""
        p = jnp.exp(_scores(q, k, query_pos, key_pos, scale) - lse[:, None])
        dp = plgpu.dot(do, v.T)
        if rate:
            keep = keep_mask(seed_ref[0], query_pos, key_pos, seq, rate)
            inverse = 1.0 / (1.0 - rate)
            dp = jnp.where(keep, dp * inverse, 0.0)
            p_kept = jnp.where(keep, p * inverse, 0.0)
        else:
            p_kept = p
        return p * (dp - delta[:, None]) * scale, p_kept

    # dK, dV of key block `index` over the query blocks that see it (causal: from it on).
    key_block = pl.ds(index * block, block)
    key_pos = index * block + jnp.arange(block)
    k = plgpu.load(k_ref.at[key_block, :], mask=lanes, other=0.0)
    v = plgpu.load(v_ref.at[key_block, :], mask=lanes, other=0.0)

    def over_queries(start_q, carry):
        dk, dv = carry
        rows = pl.ds(start_q * block, block)
        query_pos = start_q * block + jnp.arange(block)
        q = plgpu.load(q_ref.at[rows, :], mask=lanes, other=0.0)
        do = plgpu.load(do_ref.at[rows, :], mask=lanes, other=0.0)
        ds, p_kept = gradient_of_scores(
            q, k, v, do, lse_ref[rows], delta_ref[rows], query_pos, key_pos
        )
        dv = dv + plgpu.dot(p_kept.astype(do.dtype).T, do)
        return dk + plgpu.dot(ds.astype(q.dtype).T, q), dv

    zeros = jnp.zeros((block, width), jnp.float32)
    dk, dv = jax.lax.fori_loop(index, pl.cdiv(seq, block), over_queries, (zeros, zeros))
    plgpu.store(dk_ref, dk.astype(dk_ref.dtype), mask=lanes)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=lanes)

    # dQ of query block `index` over the key blocks it sees (causal: up to it).
    rows = pl.ds(index * block, block)
    query_pos = index * block + jnp.arange(block)
    q = plgpu.load(q_ref.at[rows, :], mask=lanes, other=0.0)
    do = plgpu.load(do_ref.at[rows, :], mask=lanes, other=0.0)
    lse, delta = lse_ref[rows], delta_ref[rows]

    def over_keys(start_k, dq):
        keys = pl.ds(start_k * block, block)
        key_pos = start_k * block + jnp.arange(block)
        k = plgpu.load(k_ref.at[keys, :], mask=lanes, other=0.0)
        v = plgpu.load(v_ref.at[keys, :], mask=lanes, other=0.0)
        ds, _ = gradient_of_scores(q, k, v, do, lse, delta, query_pos, key_pos)
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, index + 1, over_keys, zeros)
    plgpu.store(dq_ref, dq.astype(dq_ref.dtype), mask=lanes)


def _padded(head_dim):
    return max(16, pl.next_power_of_2(head_dim))


def _seed_spec(order):
    """The BlockSpec of the (batch, heads, 1) seeds: one per program; `order` picks batch and
    head out of the grid indices."""
    return pl.BlockSpec((None, None, 1), lambda *grid: (*order(*grid), 0))


def _forward(q, k, v, seeds, rate, interpret):
    batch, seq, heads, head_dim = q.shape
    width = _padded(head_dim)
    block_q, _ = _block_sizes(width, seq)
    rows = pl.BlockSpec((None, block_q, None, width), lambda i, b, h: (b, i, h, 0))
    whole = pl.BlockSpec((None, seq, None, width), lambda i, b, h: (b, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, rate=rate, block_k=block_q, head_dim=head_dim),
        grid=(seq // block_q, batch, heads),
        in_specs=[rows, whole, whole, _seed_spec(lambda i, b, h: (b, h))],
        out_specs=[rows, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[q, jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2),
        interpret=interpret,
        name=FORWARD,
    )(q, k, v, seeds)


def _backward(q, k, v, seeds, out, lse, d_out, rate, interpret):
    batch, seq, heads, head_dim = q.shape
    width = _padded(head_dim)
    _, block = _block_sizes(width, seq)
    # rowsum(dO * O): elementwise, left to XLA.
    delta = jnp.einsum('bqhd,bqhd->bhq', d_out.astype(jnp.float32), out.astype(jnp.float32))
    whole = pl.BlockSpec((None, seq, None, width), lambda b, h, i: (b, 0, h, 0))
    per_query = pl.BlockSpec((None, None, seq), lambda b, h, i: (b, h, 0))
    block_out = pl.BlockSpec((None, block, None, width), lambda b, h, i: (b, i, h, 0))
    return pl.pallas_call(
        functools.partial(_backward_kernel, rate=rate, block=block, head_dim=head_dim),
        grid=(batch, heads, seq // block),
        in_specs=[
            whole,
            whole,
            whole,
            _seed_spec(lambda b, h, i: (b, h)),
            whole,
            per_query,
            per_query,
        ],
        out_specs=[block_out] * 3,
        out_shape=[q, k, v],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=BACKWARD,
    )(q, k, v, seeds, d_out, lse, delta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def flash_attention(q, k, v, seeds, rate=0.0, interpret=False):
    """Causal attention context (batch, seq, heads, head_dim) of q, k, v of that shape, in
    their dtype; seeds: (batch, heads) uint32 (head_seeds), read only when rate > 0."""
    return _forward(q, k, v, seeds[..., None], rate, interpret)[0]


def _flash_forward(q, k, v, seeds, rate, interpret):
    out, lse = _forward(q, k, v, seeds[..., None], rate, interpret)
    return out, (q, k, v, seeds, out, lse)


def _flash_backward(rate, interpret, saved, d_out):
    q, k, v, seeds, out, lse = saved
    dq, dk, dv = _backward(q, k, v, seeds[..., None], out, lse, d_out, rate, interpret)
    return dq, dk, dv, None


flash_attention.defvjp(_flash_forward, _flash_backward)


def reference(q, k, v, seeds, rate=0.0):
    """What flash_attention computes, with materialised scores and the same dropout bits:
    the tests' yardstick."""
    batch, seq, heads, head_dim = q.shape
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)
    s = s / math.sqrt(head_dim)
    pos = jnp.arange(seq)
    s = jnp.where(pos[:, None] >= pos[None, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    if rate:
        keep = jax.vmap(jax.vmap(lambda seed: keep_mask(seed, pos, pos, seq, rate)))(seeds)
        p = jnp.where(keep, p / (1.0 - rate), 0.0)
    return jnp.einsum('bhqk,bkhd->bqhd', p.astype(q.dtype), v).astype(q.dtype)
