"""Causal flash attention with attention dropout, grouped-query heads and packed documents, in
Pallas (Triton on NVIDIA GPUs).

    flash_attention(q, k, v, seeds=None, rate=0.0, *, segment_ids=None, q_offset=None,
                    interpret=False, generation=None, tiles=None) -> context

    q            (batch, seq, heads, head_dim)       bf16 / fp16 on a GPU; any float interpreted
    k, v         (batch, seq, kv_heads, head_dim)    kv_heads divides heads: query head h reads
                                                     key/value head h // (heads / kv_heads);
                                                     the repeated heads are never materialised
    seeds        (batch, heads) uint32 (head_seeds), read only when rate > 0
    segment_ids  (batch, seq) int32 or None: a query sees the keys at or before it with its
                 own segment id (packed documents that do not see each other); no
                 (seq x seq) mask is ever made
    q_offset     None, or (context parallelism) an int32 scalar, traced or not: q is a chunk
                 of queries at q_offset, q_offset + 1, ... among k's keys (its length a
                 multiple of q's, q_offset of it), segment_ids then the keys'; the kernels
                 walk only the key blocks up to the chunk's diagonal
    generation   the GPU's compute capability major (8: A100, 9: H100) for the block sizes,
                 None: the A100's (they fit every GPU since)
    tiles        a Blocks to use instead (bench/gpu_check.py's sweep)
    context      (batch, seq, heads, head_dim) in q's dtype

Why by hand: cuDNN's flash attention (jax.nn.dot_product_attention) takes head dimensions of at
most 128 before Hopper (MT-NLG's is 160) and draws its dropout masks from a seed fixed when the
step is compiled; JAX's own Pallas kernel (jax.experimental.pallas.ops.gpu.attention) has no
dropout, GQA or segments. This one draws each dropout byte from a counter hash of

    (seed of the sequence and head, query position, key position // 4)

so a mask depends on nothing but the sequence's own dropout key, the site and the global head:
the same whatever the mesh layout, micro-batching or pipeline schedule (the promise the plain
path keeps with jax.random, parallel/rules.py's per-sequence keys). The two paths draw
different masks from the same keys; each is reproducible. The rate is rounded to 1/256
(flash_kernels.dropout_threshold).

    forward   grid (query block, batch, head): one query block against the visible key
              blocks with an online softmax (exp2); keeps the log-sum-exp per query
    dK, dV    grid (batch, kv head, key block): over the group's query heads and the query
              blocks that see the key block (4 score-sized matmuls: S, dP, dV, dK)
    dQ        grid (batch, head, query block): over the key blocks it sees (3: S, dP, dQ)
              -- the scores are recomputed from q, k and the log-sum-exp in both backward
              kernels (FlashAttention-2), never stored

With dropout, P' = keep * P / (kept fraction) is what multiplies V, the softmax normaliser is
P's, and dS = P * (keep * dP' / (kept fraction) - rowsum(dO * O)). The kernel bodies are in
model/flash_kernels.py. `interpret=True` runs the same kernels on any backend (the tests, on
CPU). Under `model.remat=selective` the forward's out and log-sum-exp are kept by name
(SAVED_NAMES), so the backward does not run the forward kernel again.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mtnlg_jax.model import flash_kernels
from mtnlg_jax.model.flash_kernels import MASKED, keep_mask, keep_scale

# The kernels' names (they name the compiled custom calls) and the score-sized matmuls each
# runs, for the planner's FLOP count.
FORWARD, KEY_VALUE, QUERY = (
    'flash_attention_forward',
    'flash_attention_dkv',
    'flash_attention_dq',
)
KERNEL_MATMULS = {FORWARD: 2, KEY_VALUE: 4, QUERY: 3}
# What the forward keeps for the backward, by name (model.remat=selective saves them).
SAVED_NAMES = ('flash_out', 'flash_lse')
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # Triton's smallest matmul tile


class Blocks(NamedTuple):
    forward_q: int
    forward_k: int
    backward: int
    forward_warps: int
    backward_warps: int
    stages: int = 2


# Blocks per GPU generation and lane width (what passes XLA:GPU's shared-memory check: A100s
# have 164 KiB a multiprocessor, H100s 228 KiB), the largest first; bench/gpu_check.py sweeps
# them on a device. Hopper's: the fastest of that sweep on an H200 (docs/benchmarks.md).
_BLOCKS = {
    8: ((64, Blocks(128, 64, 32, 4, 4)), (128, Blocks(128, 64, 32, 8, 4)),
        (256, Blocks(64, 64, 32, 8, 4))),
    9: ((64, Blocks(128, 128, 64, 4, 4)), (128, Blocks(128, 128, 64, 8, 4)),
        (256, Blocks(128, 64, 64, 8, 4))),
}  # fmt: skip


def lane_pieces(head_dim):
    """The head dimension as at most two (offset, width) pieces of powers of two, >= 16 each:
    160 -> 128 + 32, 96 -> 64 + 32, 64 -> 64, 8 -> 16 (lanes past head_dim load as zeros)."""
    total = max(MIN_BLOCK, -(-head_dim // MIN_BLOCK) * MIN_BLOCK)
    first = 1 << (total.bit_length() - 1)
    if first == total:
        return ((0, first),)
    return ((0, first), (first, max(MIN_BLOCK, pl.next_power_of_2(total - first))))


def lane_width(head_dim):
    """The lanes every score-sized matmul runs over (what the planner counts)."""
    return sum(width for _, width in lane_pieces(head_dim))


def _largest_block(seq, most):
    """The largest power of two <= most dividing seq (Triton tiles are powers of two)."""
    block = most
    while block > 1 and seq % block:
        block //= 2
    return block


def blocks(seq, head_dim, generation=None):
    """The Blocks of this shape on a GPU of this compute capability major (None: A100)."""
    table = _BLOCKS.get(generation, _BLOCKS[8] if (generation or 8) < 9 else _BLOCKS[9])
    width = lane_width(head_dim)
    chosen = (
        next(b for lanes, b in table if width <= lanes) if width <= MAX_HEAD_DIM else table[-1][1]
    )
    return chosen._replace(
        forward_q=_largest_block(seq, chosen.forward_q),
        forward_k=_largest_block(seq, chosen.forward_k),
        backward=_largest_block(seq, chosen.backward),
    )


def refusal(seq, head_dim, generation=None):
    """Why the kernel cannot take this shape (one phrase), or None."""
    if lane_width(head_dim) > MAX_HEAD_DIM:
        return f'head dim {head_dim} (at most {MAX_HEAD_DIM})'
    chosen = blocks(seq, head_dim, generation)
    if min(chosen.forward_q, chosen.forward_k, chosen.backward) < MIN_BLOCK:
        return f'sequence length {seq} (a multiple of {MIN_BLOCK})'
    return None


def score_area(queries, keys, block):
    """Score elements per (sequence, head) the kernels compute for `queries` queries
    against `keys` keys in tiles of `block` query rows: the causal triangle, its diagonal
    tiles whole, n (n + block) / 2; a context-parallel call (keys > queries: a chunk of n
    queries at an offset o among the keys) adds the n x o keys before the chunk. The offset
    is traced; a rank's two chunks (r and 2c - 1 - r, parallel/context.py) have offsets
    summing to keys - n, so each call is counted at their mean, (keys - n) / 2: exact for the
    pair (the work every rank does)."""
    offset = (keys - queries) / 2
    return queries * offset + queries * (queries + block) / 2


def head_seeds(row_keys, site, heads):
    """(batch, heads) uint32 dropout seeds from one PRNG key per sequence (batch,) and the
    dropout site: the global head is part of the draw, so a head's mask is the same on
    whichever device holds it."""
    return jax.vmap(lambda key: jax.random.bits(jax.random.fold_in(key, site), (heads,)))(
        row_keys
    ).astype(jnp.uint32)


class _Static(NamedTuple):
    """What the kernels are specialised on (hashable: custom_vjp's nondiff argument)."""

    rate: float
    interpret: bool
    generation: int | None
    segments: bool
    tiles: Blocks | None = None
    offset: bool = False  # queries at a traced offset among the keys (context parallelism)


def _common(q, static):
    batch, seq, heads, head_dim = q.shape
    chosen = static.tiles or blocks(seq, head_dim, static.generation)
    common = dict(
        head_dim=head_dim, pieces=lane_pieces(head_dim), rate=static.rate, segments=static.segments
    )
    if static.offset:
        common['offset'] = True
    return common, chosen


def _offset_specs(static, q_offset):
    """The query offset's block spec and arg (a (1,) int32), where the kernel takes one."""
    if not static.offset:
        return [], []
    spec = pl.BlockSpec((1,), lambda *_: (0,))
    return [spec], [jnp.reshape(q_offset, (1,)).astype(jnp.int32)]


def _forward(q, k, v, seeds, segment_ids, q_offset, static):
    batch, seq, heads, head_dim = q.shape
    keys = k.shape[1]
    group = heads // k.shape[2]
    width = lane_width(head_dim)
    common, chosen = _common(q, static)
    block_q = chosen.forward_q
    rows = pl.BlockSpec((None, block_q, None, width), lambda i, b, h: (b, i, h, 0))
    whole = pl.BlockSpec((None, keys, None, width), lambda i, b, h: (b, 0, h // group, 0))
    specs = [rows, whole, whole, pl.BlockSpec((None, None, 1), lambda i, b, h: (b, h, 0))]
    args = [q, k, v, seeds[..., None]]
    if static.segments:
        specs.append(pl.BlockSpec((None, keys), lambda i, b, h: (b, 0)))
        args.append(segment_ids)
    offset_spec, offset_arg = _offset_specs(static, q_offset)
    specs, args = specs + offset_spec, args + offset_arg
    return pl.pallas_call(
        functools.partial(flash_kernels.forward_kernel, block_k=chosen.forward_k, **common),
        grid=(seq // block_q, batch, heads),
        in_specs=specs,
        out_specs=[rows, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[q, jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        compiler_params=plgpu.CompilerParams(
            num_warps=chosen.forward_warps, num_stages=chosen.stages
        ),
        interpret=static.interpret,
        name=FORWARD,
    )(*args)


def _backward(q, k, v, seeds, segment_ids, q_offset, out, lse, d_out, static):
    batch, seq, heads, head_dim = q.shape
    keys = k.shape[1]
    kv_heads = k.shape[2]
    group = heads // kv_heads
    width = lane_width(head_dim)
    common, chosen = _common(q, static)
    block = chosen.backward
    # rowsum(dO * O), base-2 units as the log-sum-exp: elementwise, left to XLA.
    delta = jnp.einsum('bqhd,bqhd->bhq', d_out.astype(jnp.float32), out.astype(jnp.float32))
    params = plgpu.CompilerParams(num_warps=chosen.backward_warps, num_stages=chosen.stages)
    segments = [segment_ids] if static.segments else []
    segment_spec = [pl.BlockSpec((None, keys), lambda b, h, i: (b, 0))] if static.segments else []
    offset_spec, offset_arg = _offset_specs(static, q_offset)
    segment_spec, segments = segment_spec + offset_spec, segments + offset_arg

    # dK, dV: one program per (batch, kv head, key block), over the group's query heads.
    grouped = pl.BlockSpec((None, seq, group, width), lambda b, h, i: (b, 0, h, 0))
    key_rows = pl.BlockSpec((None, block, None, width), lambda b, h, i: (b, i, h, 0))
    per_group = pl.BlockSpec((None, group, seq), lambda b, h, i: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(flash_kernels.key_value_kernel, block=block, **common),
        grid=(batch, kv_heads, keys // block),
        in_specs=[
            grouped,
            key_rows,
            key_rows,
            pl.BlockSpec((None, group, 1), lambda b, h, i: (b, h, 0)),
            grouped,
            per_group,
            per_group,
            *segment_spec,
        ],  # fmt: skip
        out_specs=[key_rows, key_rows],
        out_shape=[k, v],
        compiler_params=params,
        interpret=static.interpret,
        name=KEY_VALUE,
    )(q, k, v, seeds[..., None], d_out, lse, delta, *segments)

    # dQ: one program per (batch, query head, query block).
    query_rows = pl.BlockSpec((None, block, None, width), lambda b, h, i: (b, i, h, 0))
    whole_kv = pl.BlockSpec((None, keys, None, width), lambda b, h, i: (b, 0, h // group, 0))
    per_query = pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(flash_kernels.query_kernel, block=block, **common),
        grid=(batch, heads, seq // block),
        in_specs=[
            query_rows,
            whole_kv,
            whole_kv,
            pl.BlockSpec((None, None, 1), lambda b, h, i: (b, h, 0)),
            query_rows,
            per_query,
            per_query,
            *segment_spec,
        ],  # fmt: skip
        out_specs=query_rows,
        out_shape=q,
        compiler_params=params,
        interpret=static.interpret,
        name=QUERY,
    )(q, k, v, seeds[..., None], d_out, lse, delta, *segments)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, seeds, segment_ids, q_offset, static):
    return _forward(q, k, v, seeds, segment_ids, q_offset, static)[0]


def _attention_forward(q, k, v, seeds, segment_ids, q_offset, static):
    out, lse = _forward(q, k, v, seeds, segment_ids, q_offset, static)
    out, lse = checkpoint_name(out, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
    return out, (q, k, v, seeds, segment_ids, q_offset, out, lse)


def _attention_backward(static, saved, d_out):
    q, k, v, seeds, segment_ids, q_offset, out, lse = saved
    dq, dk, dv = _backward(q, k, v, seeds, segment_ids, q_offset, out, lse, d_out, static)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_forward, _attention_backward)


def flash_attention(
    q, k, v, seeds=None, rate=0.0, *, segment_ids=None, q_offset=None, interpret=False,
    generation=None, tiles=None,
):  # fmt: skip
    """Causal attention context of q over k, v; see the module docstring for the shapes.
    q_offset (an int32 scalar, may be traced): the queries are at q_offset, q_offset + 1, ...
    among the keys (a context-parallel chunk: q_offset a multiple of q's length, which
    divides the keys'), segment_ids then the keys'; None: q and k of one length."""
    batch, seq, heads, head_dim = q.shape
    keys = seq if q_offset is None else k.shape[1]
    if k.shape != v.shape or k.shape[:2] != (batch, keys) or heads % k.shape[2] or keys % seq:
        raise ValueError(f'flash_attention: q {q.shape} against k {k.shape}, v {v.shape}')
    if refusal(seq, head_dim, generation):
        raise ValueError(f'flash_attention cannot take {refusal(seq, head_dim, generation)}')
    if seeds is None or not rate:
        seeds = jnp.zeros((batch, heads), jnp.uint32)
    segments, offset = segment_ids is not None, q_offset is not None
    static = _Static(float(rate), bool(interpret), generation, segments, tiles, offset)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    if offset:
        q_offset = jnp.asarray(q_offset, jnp.int32)
    return _attention(q, k, v, seeds.astype(jnp.uint32), segment_ids, q_offset, static)


def reference(q, k, v, seeds=None, rate=0.0, segment_ids=None, q_offset=0):
    """What flash_attention computes, with materialised scores, repeated key/value heads and
    the same dropout bits: the tests' yardstick."""
    batch, seq, heads, head_dim = q.shape
    keys = k.shape[1]
    group = heads // k.shape[2]
    k, v = (jnp.repeat(a, group, axis=2) for a in (k, v))
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(head_dim))
    pos, key_pos = q_offset + jnp.arange(seq), jnp.arange(keys)
    visible = (pos[:, None] >= key_pos[None, :])[None, None]
    if segment_ids is not None:
        query_ids = segment_ids[:, pos]
        visible = visible & (query_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.where(visible, s, MASKED)
    p = jax.nn.softmax(s, axis=-1)
    if rate:
        keep = jax.vmap(jax.vmap(lambda seed: keep_mask(seed, pos, 0, keys, rate)))(seeds)
        p = jnp.where(keep, p * keep_scale(rate), 0.0)
    return jnp.einsum('bhqk,bkhd->bqhd', p.astype(q.dtype), v).astype(q.dtype)
