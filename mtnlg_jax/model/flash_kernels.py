"""The Pallas bodies of the flash attention kernels (model/flash_attention.py calls them).

Every tile works in base 2: the scores are q k^T x scale x log2(e), so the online softmax
uses exp2 (one instruction on the GPU's SFU) and the kept log-sum-exp is base 2. The head
dimension comes in at most two lane pieces of powers of two (Triton's tiles are), e.g. 160 as
128 + 32 (not 256: 60 % more work in every score-sized matmul); each matmul over the head
dimension is a sum over the pieces. Lanes past the head dimension (head dims not a multiple
of 16) load as zeros.

Which tiles are masked: a key block wholly below the diagonal needs no causal mask, so every
loop runs in two parts, the unmasked blocks below the diagonal and the few that cross it.
With segment ids (packed documents), every tile also compares segments.

Dropout: one 32-bit hash of (seed, query, key // 4) gives the decisions of 4 neighbouring
keys, one byte each (FlashAttention-2 draws bytes too); the rate is rounded to 1/256 and the
kept values scaled by 256 / (256 - threshold), so the dropout stays unbiased. The mask depends
on (seed, query position, key position) only: the same in the forward and backward kernels,
whatever their blocks.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASKED = -1e30  # finite: a fully masked row never produces NaN
LOG2_E = math.log2(math.e)
KEYS_PER_HASH = 4


def fmix32(x):
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with p ~ 1/2."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def dropout_threshold(rate):
    """The byte below which a probability is dropped: rate x 256, rounded, in 1 .. 255."""
    return min(max(round(rate * 256), 1), 255)


def keep_scale(rate):
    """What a kept probability is multiplied by: 1 / (kept fraction) of the rounded rate."""
    return 256.0 / (256 - dropout_threshold(rate))


def keep_mask(seed, query_pos, first_key, num_keys, rate):
    """Which of the (len(query_pos), num_keys) probabilities of keys first_key, ... (a multiple
    of 4) survive dropout: byte key % 4 of hash(seed, query, key // 4) >= the threshold. Runs
    inside the kernels and, for the reference, outside them."""
    rows = fmix32(seed ^ (query_pos.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)))
    groups = (first_key // KEYS_PER_HASH + jnp.arange(num_keys // KEYS_PER_HASH)).astype(jnp.uint32)
    bits = fmix32(rows[:, None] + groups[None, :] * jnp.uint32(0x27D4EB2F))
    shifts = (jnp.arange(KEYS_PER_HASH, dtype=jnp.uint32) * jnp.uint32(8))[None, None, :]
    bytes_ = (bits[:, :, None] >> shifts) & jnp.uint32(0xFF)
    keep = bytes_ >= jnp.uint32(dropout_threshold(rate))
    return keep.reshape(query_pos.shape[0], num_keys)


class Tile:
    """What every kernel shares: the head dimension's lane pieces, the scale, the dropout
    rate, and the refs of the seeds and (optional) segment ids."""

    def __init__(self, head_dim, pieces, rate=0.0, seed=None, segment_ref=None):
        self.head_dim, self.pieces, self.rate = head_dim, pieces, rate
        self.scale = 1.0 / math.sqrt(head_dim)
        self.seed, self.segment_ref = seed, segment_ref

    def load(self, ref, *index):
        """The lane pieces of ref[*index, lanes] (one indexer: Pallas-Triton takes no chain
        of them); lanes past the head dimension as zeros."""
        out = []
        for offset, width in self.pieces:
            at = ref.at[(*index, pl.ds(offset, width))]
            if offset + width > self.head_dim:
                mask = (offset + jnp.arange(width) < self.head_dim)[None, :]
                out.append(plgpu.load(at, mask=mask, other=0.0))
            else:
                out.append(plgpu.load(at))
        return out

    def store(self, ref, pieces, dtype):
        for (offset, width), value in zip(self.pieces, pieces):
            mask = None
            if offset + width > self.head_dim:
                mask = (offset + jnp.arange(width) < self.head_dim)[None, :]
            plgpu.store(ref.at[:, pl.ds(offset, width)], value.astype(dtype), mask=mask)

    def scores(self, q, k, start_q, start_k, causal):
        """Base-2 scores of the query block at start_q against the key block at start_k,
        fp32: masked where a key is after the query (causal tiles only) or in another
        segment."""
        block_q, block_k = q[0].shape[0], k[0].shape[0]
        s = sum(plgpu.dot(qp, kp.T) for qp, kp in zip(q, k)) * (self.scale * LOG2_E)
        visible = None
        if causal:
            visible = (start_q + jnp.arange(block_q))[:, None] >= (start_k + jnp.arange(block_k))[
                None, :
            ]
        if self.segment_ref is not None:
            same = (
                self.segment_ref[pl.ds(start_q, block_q)][:, None]
                == self.segment_ref[pl.ds(start_k, block_k)][None, :]
            )
            visible = same if visible is None else visible & same
        return s if visible is None else jnp.where(visible, s, MASKED)

    def keep(self, start_q, block_q, start_k, block_k):
        query_pos = start_q + jnp.arange(block_q)
        return keep_mask(self.seed, query_pos, start_k, block_k, self.rate)

    def gradient_of_scores(self, q, k, v, do, lse, delta, start_q, start_k, causal):
        """(dS, P') of one tile: dS = P (dP' - delta) x scale, P' = P with dropout."""
        p = jnp.exp2(self.scores(q, k, start_q, start_k, causal) - lse[:, None])
        dp = sum(plgpu.dot(dop, vp.T) for dop, vp in zip(do, v))
        p_kept = p
        if self.rate:
            keep = self.keep(start_q, p.shape[0], start_k, p.shape[1])
            inverse = keep_scale(self.rate)
            dp = jnp.where(keep, dp * inverse, 0.0)
            p_kept = jnp.where(keep, p * inverse, 0.0)
        return p * (dp - delta[:, None]) * self.scale, p_kept


def two_part_loop(unmasked, end, body, carry):
    """body(block, carry, causal) over blocks [0, unmasked) without the causal mask, then
    [unmasked, end) with it (the blocks that cross the diagonal)."""
    carry = jax.lax.fori_loop(0, unmasked, lambda j, c: body(j, c, False), carry)
    return jax.lax.fori_loop(unmasked, end, lambda j, c: body(j, c, True), carry)


def _split_refs(refs, segments, inputs, offset=False):
    """(inputs..., segment ref or None, query offset or 0, outputs...) of a kernel's refs."""
    head, rest = refs[:inputs], refs[inputs:]
    segment_ref = query_offset = None
    if segments:
        segment_ref, rest = rest[0], rest[1:]
    if offset:
        query_offset, rest = rest[0][0], rest[1:]
    return head, segment_ref, 0 if query_offset is None else query_offset, rest


def _zeros(rows, pieces):
    return [jnp.zeros((rows, width), jnp.float32) for _, width in pieces]


def forward_kernel(*refs, rate, block_k, head_dim, pieces, segments, offset=False):
    """Grid (query block, batch, head): the block against the keys it sees, online softmax;
    refs q, k, v, seed, [segment ids], [query offset], out, lse (base 2). With an offset the
    queries are at offset, offset + 1, ... among the keys (a context-parallel chunk)."""
    inputs, segment_ref, query_offset, (o_ref, lse_ref) = _split_refs(refs, segments, 4, offset)
    q_ref, k_ref, v_ref, seed_ref = inputs
    tile = Tile(head_dim, pieces, rate, seed_ref[0] if rate else None, segment_ref)
    block_q = q_ref.shape[0]
    start_q = query_offset + pl.program_id(0) * block_q
    q = tile.load(q_ref, slice(None))

    def over_keys(index, carry, causal):
        o, row_max, row_sum = carry
        start_k = index * block_k
        keys = pl.ds(start_k, block_k)
        s = tile.scores(q, tile.load(k_ref, keys), start_q, start_k, causal)
        m_next = jnp.maximum(row_max, s.max(axis=-1))
        p = jnp.exp2(s - m_next[:, None])
        correction = jnp.exp2(row_max - m_next)
        p_kept = p
        if rate:
            keep = tile.keep(start_q, block_q, start_k, block_k)
            p_kept = jnp.where(keep, p * keep_scale(rate), 0.0)
        v = tile.load(v_ref, keys)
        o = [
            correction[:, None] * op + plgpu.dot(p_kept.astype(vp.dtype), vp)
            for op, vp in zip(o, v)
        ]
        return o, m_next, correction * row_sum + p.sum(axis=-1)

    initial = (
        _zeros(block_q, pieces),
        jnp.full((block_q,), MASKED, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    unmasked = jax.lax.div(start_q, block_k)
    end = jax.lax.div(start_q + block_q + block_k - 1, block_k)
    o, row_max, row_sum = two_part_loop(unmasked, end, over_keys, initial)
    lse_ref[...] = row_max + jnp.log2(row_sum)
    tile.store(o_ref, [op / row_sum[:, None] for op in o], o_ref.dtype)


def key_value_kernel(*refs, rate, block, head_dim, pieces, segments, offset=False):
    """Grid (batch, key/value head, key block): dK, dV of the block over every query head of
    its group and the query blocks that see it (from the diagonal on). refs q (seq, group,
    lanes), k, v (block, lanes), seeds (group, 1), [segment ids], [query offset], dO (seq,
    group, lanes), lse, delta (group, seq), then dK, dV."""
    inputs, segment_ref, query_offset, (dk_ref, dv_ref) = _split_refs(refs, segments, 7, offset)
    q_ref, k_ref, v_ref, seed_ref, do_ref, lse_ref, delta_ref = inputs
    seq, group = q_ref.shape[0], q_ref.shape[1]
    index = pl.program_id(2)
    start_k = index * block
    lanes = Tile(head_dim, pieces)
    k, v = lanes.load(k_ref, slice(None)), lanes.load(v_ref, slice(None))

    def over_heads(head, carry):
        tile = Tile(head_dim, pieces, rate, seed_ref[head, 0] if rate else None, segment_ref)

        def over_queries(query_block, carry, causal):
            dk, dv = carry
            rows = pl.ds(query_block * block, block)
            start_q = query_offset + query_block * block
            q, do = tile.load(q_ref, rows, head), tile.load(do_ref, rows, head)
            lse, delta = lse_ref[head, rows], delta_ref[head, rows]
            ds, p_kept = tile.gradient_of_scores(q, k, v, do, lse, delta, start_q, start_k, causal)
            dv = [dvp + plgpu.dot(p_kept.astype(dop.dtype).T, dop) for dvp, dop in zip(dv, do)]
            dk = [dkp + plgpu.dot(ds.astype(qp.dtype).T, qp) for dkp, qp in zip(dk, q)]
            return dk, dv

        if offset:  # the diagonal block, where the chunk has it, then the blocks after it
            diagonal = jax.lax.div(start_k - query_offset, block)
            first = jnp.clip(diagonal, 0, seq // block)
            after = jnp.clip(diagonal + 1, 0, seq // block)
            carry = jax.lax.fori_loop(first, after, lambda j, c: over_queries(j, c, True), carry)
            return jax.lax.fori_loop(
                after, seq // block, lambda j, c: over_queries(j, c, False), carry
            )
        # the diagonal block is the only one the causal mask cuts
        carry = over_queries(index, carry, True)
        return jax.lax.fori_loop(
            index + 1, seq // block, lambda j, c: over_queries(j, c, False), carry
        )

    dk, dv = jax.lax.fori_loop(0, group, over_heads, (_zeros(block, pieces), _zeros(block, pieces)))
    lanes.store(dk_ref, dk, dk_ref.dtype)
    lanes.store(dv_ref, dv, dv_ref.dtype)


def query_kernel(*refs, rate, block, head_dim, pieces, segments, offset=False):
    """Grid (batch, head, query block): dQ of the block over the key blocks it sees. refs q,
    k, v (seq, lanes), seed, [segment ids], [query offset], dO, lse, delta, then dQ."""
    inputs, segment_ref, query_offset, (dq_ref,) = _split_refs(refs, segments, 7, offset)
    q_ref, k_ref, v_ref, seed_ref, do_ref, lse_ref, delta_ref = inputs
    tile = Tile(head_dim, pieces, rate, seed_ref[0] if rate else None, segment_ref)
    start_q = query_offset + pl.program_id(2) * block
    q, do = tile.load(q_ref, slice(None)), tile.load(do_ref, slice(None))
    lse, delta = lse_ref[...], delta_ref[...]

    def over_keys(index, dq, causal):
        start_k = index * block
        keys = pl.ds(start_k, block)
        k, v = tile.load(k_ref, keys), tile.load(v_ref, keys)
        ds, _ = tile.gradient_of_scores(q, k, v, do, lse, delta, start_q, start_k, causal)
        return [dqp + plgpu.dot(ds.astype(kp.dtype), kp) for dqp, kp in zip(dq, k)]

    diagonal = jax.lax.div(start_q, block) if offset else pl.program_id(2)
    dq = two_part_loop(diagonal, diagonal + 1, over_keys, _zeros(block, pieces))
    tile.store(dq_ref, dq, dq_ref.dtype)
