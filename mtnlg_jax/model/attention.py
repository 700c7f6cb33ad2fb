"""Causal self-attention (Attention): multi-head, grouped-query or multi-query, rope or learned
positions, packed documents' segment masks, context parallelism's chunks at their global
positions, the KV cache of generation, and the kernel attention_kernel picked (cuDNN, the
Pallas flash kernel, XLA's, or the plain einsums around the (seq x seq) scores).

Tensor parallelism splits heads (column-parallel projections in, row-parallel out): each rank
holds whole groups of query heads with their key/value head.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mtnlg_jax.model import flash_attention, fp8_sites, rope
from mtnlg_jax.model.attention_kernel import context_kernel, documents_kernel
from mtnlg_jax.model.layers import (
    ATTN_PROBS,
    add_bias,
    attention_dims,
    dropout,
    gathers_once,
    maybe_bias,
    onto_residual,
    out_std,
    param,
    project,
    use,
)
from mtnlg_jax.parallel import context as context_lib
from mtnlg_jax.parallel import taps
from mtnlg_jax.parallel.rules import constrain, gather, gather_context, local_call, shards

CONTEXT_AXES = ('batch', 'seq', 'heads', 'head_dim')
Q_AXES = CONTEXT_AXES
KV_AXES = ('batch', 'seq', 'kv_heads', 'head_dim')
Q_KERNEL_AXES = ('embed', 'heads', 'head_dim')
KV_KERNEL_AXES = ('embed', 'qkv', 'kv_heads', 'head_dim')
GROUPED_AXES = ('batch', 'seq', 'kv_heads', 'q_per_kv', 'head_dim')
SEED_AXES = ('batch', 'heads')
SEGMENT_AXES = ('batch', 'seq')
KV_GATHERED_AXES = ('batch', 'kv_seq', 'kv_heads', 'head_dim')  # whole over 'context'
KV_SEGMENT_AXES = ('batch', 'kv_seq')


def same_segment(segment_ids):
    """(batch, 1, seq, seq) bool: query and key in the same segment (broadcast over heads)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


class Attention(nnx.Module):
    """Causal self-attention of `heads` query heads over `kv_heads` key/value heads, softmax
    in fp32; kv_heads = heads is multi-head attention, fewer is grouped-query attention (one:
    multi-query), query head i reading key/value head i // (heads / kv_heads) as Hugging
    Face's repeat_kv does (without repeating them). Under `model.position = 'rope'` queries
    and keys are rotated by their positions (model/rope.py) after the projection.

    Parameters (E = hidden, H = heads, K = kv_heads, D = head_dim; biases only with
    `model.bias`):
        K = H:  qkv_kernel (E, 3, H, D), qkv_bias (3, H, D)       query, key, value fused
        K < H:  q_kernel (E, H, D), q_bias (H, D),
                kv_kernel (E, 2, K, D), kv_bias (2, K, D)         key, value fused
        out_kernel (H, D, E), out_bias (E,)

    Tensor parallelism splits `heads` and `kv_heads` over `tensor` (column parallel in,
    row parallel out), so each rank holds whole groups: a query head's key/value head is on
    its own rank. mesh.tensor must divide kv_heads (config/checks.py refuses otherwise)."""

    def __init__(self, cfg, rngs, kernel='plain', gpu_generation=None):
        heads, kv_heads, head_dim = attention_dims(cfg)
        hidden, std = cfg.hidden, cfg.init_std
        if kv_heads == heads:
            self.qkv_kernel = param(
                rngs, (hidden, 3, heads, head_dim), ('embed', 'qkv', 'heads', 'head_dim'), std
            )
            self.qkv_bias = maybe_bias(cfg, (3, heads, head_dim), ('qkv', 'heads', 'head_dim'))
        else:
            self.q_kernel = param(rngs, (hidden, heads, head_dim), Q_KERNEL_AXES, std)
            self.kv_kernel = param(rngs, (hidden, 2, kv_heads, head_dim), KV_KERNEL_AXES, std)
            self.q_bias = maybe_bias(cfg, (heads, head_dim), Q_AXES[2:])
            self.kv_bias = maybe_bias(cfg, (2, kv_heads, head_dim), KV_KERNEL_AXES[1:])
        self.out_kernel = param(
            rngs, (heads, head_dim, hidden), ('heads', 'head_dim', 'embed'), out_std(cfg)
        )
        self.out_bias = maybe_bias(cfg, (hidden,), ('embed',))
        self.grouped = kv_heads != heads
        # model.qk_norm: the scales of the queries' (row 0) and keys' (row 1) RMSNorm
        ones = jnp.ones((2, head_dim), jnp.float32)
        qk_norm = cfg.get('qk_norm', False)
        self.qk_norm = nnx.Param(ones, logical_axes=('qkv', 'head_dim')) if qk_norm else None
        self.epsilon = cfg.layer_norm_epsilon
        self.inv_freq = None  # static: a tuple of floats, folded into the compiled step
        if cfg.get('position', 'learned') == 'rope':
            freqs = rope.inverse_frequencies(head_dim, cfg.rope_theta, cfg.rope_scaling)
            self.inv_freq = tuple(float(f) for f in freqs)
        self.dropout_rate = cfg.attention_dropout
        self.dtype = cfg.compute_dtype
        self.gather_once = gathers_once(cfg)
        self.fp8 = fp8_sites.settings(cfg)
        self.kernel = kernel  # attention_kernel()'s choice
        self.gpu_generation = gpu_generation  # the flash kernel's blocks are chosen for it

    def project_qkv(self, x, positions=None):
        """(batch, seq, embed) -> q (batch, seq, heads, head_dim), k and v (batch, seq,
        kv_heads, head_dim), split over heads; q and k rotated under rope (positions: (seq,)
        or (batch, seq); None: 0 .. seq - 1). Selective recompute keeps the projections
        (named 'qkv') and recomputes the rotation."""
        return self.rotated(*self.projections(x), positions)

    def projections(self, x):
        """q, k, v of x before rope: project_qkv's matmuls alone."""
        if self.fp8 is not None:
            q, k, v = self.projections_fp8(x)
        elif not self.grouped:
            qkv = self.matmul(self.qkv_kernel, 'bse,ethd->bsthd', x)
            qkv = add_bias(qkv, self.qkv_bias, self.dtype)
            qkv = constrain(qkv, ('batch', 'seq', 'qkv', 'heads', 'head_dim'))
            qkv = checkpoint_name(qkv, 'qkv')
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = self.matmul(self.q_kernel, 'bse,ehd->bshd', x)
            q = checkpoint_name(constrain(add_bias(q, self.q_bias, self.dtype), Q_AXES), 'qkv')
            kv = self.matmul(self.kv_kernel, 'bse,ethd->bsthd', x)
            kv = add_bias(kv, self.kv_bias, self.dtype)
            kv = checkpoint_name(constrain(kv, ('batch', 'seq') + KV_KERNEL_AXES[1:]), 'qkv')
            k, v = kv[:, :, 0], kv[:, :, 1]
        if self.qk_norm is not None:
            q, k = (self.head_norm(a, i) for i, a in enumerate((q, k)))
        return q, k, v

    def matmul(self, kernel, spec, x):
        """x times a projection kernel in the compute dtype (parallel/taps.py's einsum)."""
        return taps.matmul(kernel, spec, x, use(kernel, self.dtype))

    def projections_fp8(self, x):
        """q, k, v of x under model.fp8 (model/fp8_sites.py): one FP8 product a kernel; q's
        and kv's of one quantized x (fp8_sites.project's shared), kept once for the backward."""
        if not self.grouped:
            parts = self.fp8_slots('qkv', x, self.qkv_kernel, self.qkv_bias)
        else:
            shared = {}
            q = fp8_sites.project(self.fp8, 'q', x, use(self.q_kernel, self.dtype), shared=shared)
            parts = [add_bias(q, self.q_bias, self.dtype)]
            parts += self.fp8_slots('kv', x, self.kv_kernel, self.kv_bias, shared)
        axes_of = (Q_AXES, KV_AXES, KV_AXES)
        return tuple(checkpoint_name(constrain(a, ax), 'qkv') for a, ax in zip(parts, axes_of))

    def fp8_slots(self, site, x, kernel, bias, shared=None):
        """The slots of a fused kernel (embed, slots, heads, head_dim) times x, bias added: one
        FP8 product, its slot axis unfolded (blockwise: one product a slot); shared:
        fp8_sites.project's."""
        w = use(kernel, self.dtype)
        b = None if bias is None else use(bias, self.dtype)
        if self.fp8[0] == 'blockwise':
            slots = [fp8_sites.project(self.fp8, site, x, w[:, i]) for i in range(w.shape[1])]
        else:
            fused = fp8_sites.project(self.fp8, site, x, w, shared=shared)
            slots = [fused[:, :, i] for i in range(w.shape[1])]
        return [a if b is None else a + b[i] for i, a in enumerate(slots)]

    def head_norm(self, a, i):
        """model.qk_norm: RMSNorm of each head of a (..., head_dim), fp32 inside, with the
        scale qk_norm[i] (0: queries, 1: keys), Qwen3's."""
        a32 = a.astype(jnp.float32)
        a32 = a32 * jax.lax.rsqrt(jnp.square(a32).mean(-1, keepdims=True) + self.epsilon)
        return (a32 * self.qk_norm[i].astype(jnp.float32)).astype(a.dtype)

    def rotated(self, q, k, v, positions=None):
        """q and k rotated by their positions under rope (None: 0 .. seq - 1); v as it is."""
        if self.inv_freq is not None:
            if positions is None:
                positions = jnp.arange(q.shape[1])
            q, k = (rope.rotate(a, positions, self.inv_freq) for a in (q, k))
        return q, k, v

    def attend(self, q, k, v, visible, row_keys=None, site=0):
        """Context of queries q (batch, len, heads, head_dim) over keys k and values v (batch,
        len, kv_heads, head_dim); visible: (q_len, k_len) or (batch, 1, q_len, k_len) bool,
        which keys each query may see. Grouped: the query heads of one key/value head form a
        `q_per_kv` axis, so the keys and values are never repeated."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        if self.grouped:
            return self.attend_grouped(q, k, v, visible, row_keys, site)
        scores = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        scores = constrain(scores, ('batch', 'heads', 'seq', 'kv_seq'))
        probs = jax.nn.softmax(scores, axis=-1)
        probs = dropout(probs, self.dropout_rate, row_keys, site).astype(q.dtype)
        context = jnp.einsum('bhqk,bkhd->bqhd', probs, v.astype(q.dtype))
        return checkpoint_name(constrain(context, CONTEXT_AXES), 'context')

    def attend_grouped(self, q, k, v, visible, row_keys, site):
        """attend() for kv_heads < heads: scores (batch, kv_heads, q_per_kv, q_len, k_len)."""
        b, s, h, d = q.shape
        kv = k.shape[2]
        if visible.ndim == 4:  # (batch, 1, q_len, k_len), packed documents: over both head axes
            visible = visible[:, None]
        q = constrain(q.reshape(b, s, kv, h // kv, d), GROUPED_AXES)
        scores = jnp.einsum('bqkgd,bskd->bkgqs', q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(visible, scores / math.sqrt(d), jnp.finfo(jnp.float32).min)
        scores = constrain(scores, ('batch', 'kv_heads', 'q_per_kv', 'seq', 'kv_seq'))
        probs = jax.nn.softmax(scores, axis=-1)
        probs = dropout(probs, self.dropout_rate, row_keys, site).astype(q.dtype)
        context = jnp.einsum('bkgqs,bskd->bqkgd', probs, v.astype(q.dtype))
        context = constrain(context, GROUPED_AXES).reshape(b, s, h, d)
        return checkpoint_name(constrain(context, CONTEXT_AXES), 'context')

    def attend_fused(
        self, q, k, v, visible_keys=None, row_keys=None, site=0, segment_ids=None, kernel=None
    ):
        """The same context in one kernel (self.kernel): no (seq x seq) scores are kept, the
        backward recomputes them; q, k, v and the context in the compute dtype. Causal, or
        with visible_keys (a scalar, decoding): keys 0 .. visible_keys - 1 for every query;
        segment_ids (batch, seq): causal within each segment only (packed documents).
        Each device runs the kernel on its own batch rows and heads (rules.local_call:
        cuDNN's partitioning rule fails inside the pipeline). The flash kernel applies
        attention dropout from per-(sequence, head) seeds drawn from row_keys. kernel: the
        one to run (None: self.kernel)."""
        kernel = kernel or self.kernel
        q = constrain(q, CONTEXT_AXES)
        k, v = (constrain(a.astype(q.dtype), KV_AXES) for a in (k, v))
        if kernel in ('flash', 'flash_interpreted'):
            rate = self.dropout_rate if row_keys is not None else 0.0
            if rate:
                seeds = flash_attention.head_seeds(row_keys.reshape(-1), site, q.shape[2])
            else:
                seeds = jnp.zeros(q.shape[0:1] + q.shape[2:3], jnp.uint32)
            interpret = kernel == 'flash_interpreted'  # decided by the mesh's device

            def flash(q, k, v, seeds, *segments):  # k, v hold kv_heads: never repeated
                return flash_attention.flash_attention(
                    q, k, v, seeds, rate, segment_ids=segments[0] if segments else None,
                    interpret=interpret, generation=self.gpu_generation,
                )  # fmt: skip

            args = (q, k, v, constrain(seeds, SEED_AXES))
            axes = (CONTEXT_AXES, KV_AXES, KV_AXES, SEED_AXES)
            if segment_ids is not None:
                args, axes = args + (segment_ids,), axes + (SEGMENT_AXES,)
            context = local_call(flash, args, CONTEXT_AXES, args_axes=axes)
            # not named 'context': selective recompute keeps the kernel's own out (and its
            # log-sum-exp) by name, and the same values twice would cost a context per layer
            return constrain(context, CONTEXT_AXES)

        def fused(q, k, v, *segments_or_visible):
            lengths = mask = None
            if visible_keys is not None:
                lengths = jnp.full((q.shape[0],), segments_or_visible[0], jnp.int32)
            elif segments_or_visible:  # this device's rows: (rows, 1, seq, seq), made here
                mask = same_segment(segments_or_visible[0])
            return jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=mask,
                is_causal=visible_keys is None,
                key_value_seq_lengths=lengths,
                implementation=kernel,
            )

        if segment_ids is not None:
            args = (q, k, v, segment_ids)
            axes = (CONTEXT_AXES, KV_AXES, KV_AXES, SEGMENT_AXES)
            context = local_call(fused, args, CONTEXT_AXES, args_axes=axes)
        else:
            extra = () if visible_keys is None else (jnp.asarray(visible_keys, jnp.int32),)
            axes = (CONTEXT_AXES, KV_AXES, KV_AXES)
            context = local_call(fused, (q, k, v), CONTEXT_AXES, extra, args_axes=axes)
        if kernel == 'cudnn':  # kept as the kernel's output (gpt.remat_policy), not twice
            return constrain(context, CONTEXT_AXES)
        return checkpoint_name(constrain(context, CONTEXT_AXES), 'context')

    def project_out(self, context):
        """(batch, seq, heads, head_dim) -> (batch, seq, embed): row parallel, one all-reduce
        (sequence parallel: a reduce-scatter onto the residual stream's sequence shards)."""
        out = project(self, 'attn_out', 'bqhd,hde->bqe', context, self.out_kernel, contract=2)
        return onto_residual(out, self.out_bias, self.dtype, 'attn_out', self.gather_once)

    def __call__(self, x, row_keys, site_base, positions=None, segment_ids=None):
        """positions (seq,) or (batch, seq): the tokens' positions for rope (None: 0 .. seq
        - 1; unused with learned positions); segment_ids (batch, seq) or None: with them a
        query sees only the earlier keys of its own segment (packed documents,
        data/packing.py)."""
        q, k, v = self.project_qkv(x, positions)
        return self.project_out(self.context(q, k, v, row_keys, site_base, segment_ids))

    def context(self, q, k, v, row_keys, site_base, segment_ids=None, order=None):
        """Causal attention of rotated q, k, v (within segments, given segment_ids) by the
        kernel chosen for this device: (batch, seq, heads, head_dim). order: (batch, seq)
        the tokens' global positions under context parallelism (None: 0 .. seq - 1)."""
        site = site_base + ATTN_PROBS
        context = shards('seq')
        if context > 1:  # the flash kernel at each chunk's offset, else the plain path
            chunk = q.shape[1] * shards('seq', manual=True) // (2 * context)
            kernel = context_kernel(self.kernel, chunk, q.shape[-1], self.gpu_generation)
            if kernel.startswith('flash') and order is not None:
                return self.context_flash(q, k, v, row_keys, site, segment_ids, kernel)
            return self.context_parallel(q, k, v, row_keys, site, segment_ids, order)
        if self.kernel != 'plain':
            kernel = self.kernel
            if segment_ids is not None:  # packed documents: a kernel that takes their ids
                kernel = documents_kernel(kernel, q.shape[1], q.shape[-1], self.gpu_generation)
            return self.attend_fused(
                q, k, v, row_keys=row_keys, site=site, segment_ids=segment_ids, kernel=kernel
            )
        seq = q.shape[1]
        visible = jnp.tril(jnp.ones((seq, seq), bool))
        if segment_ids is not None:  # fused by XLA into the select on the scores
            visible = visible & same_segment(segment_ids)
        return self.attend(q, k, v, visible, row_keys, site)

    def context_parallel(self, q, k, v, row_keys, site, segment_ids, order):
        """context() with the sequence split over 'context' (parallel/context.py): each rank's
        queries (its two chunks) against every key and value, gathered over 'context' (an
        all-gather; its transpose, a reduce-scatter of their gradients: by the partitioner,
        or written out where 'context' is manual, rules.gather). A query sees a key when the
        key's global position is not later and, with segment ids, in its segment: the mask
        is made from the positions and ids that travel with the chunks."""
        if order is None:
            order = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
        k, v = (constrain(gather(a, KV_AXES, 1), KV_GATHERED_AXES) for a in (k, v))
        query_pos = constrain(order, SEGMENT_AXES)
        key_pos = constrain(gather(order, SEGMENT_AXES, 1), KV_SEGMENT_AXES)
        visible = key_pos[:, None, :] <= query_pos[:, :, None]
        if segment_ids is not None:
            ids, key_ids = (
                constrain(segment_ids, SEGMENT_AXES),
                constrain(gather(segment_ids, SEGMENT_AXES, 1), KV_SEGMENT_AXES),
            )
            visible = visible & (key_ids[:, None, :] == ids[:, :, None])
        return self.attend(q, k, v, visible[:, None], row_keys, site)

    def context_flash(self, q, k, v, row_keys, site, segment_ids, kernel):
        """context_parallel() by the Pallas flash kernel, the tokens in the chunk order
        (parallel/context.py): on each device its keys, values and segment ids gathered over
        'context' and put back in sequence order, then the kernel once per query chunk with
        that chunk's offset among the keys (it walks only the key blocks up to its diagonal);
        no (seq x seq) mask is made. kernel: 'flash' or 'flash_interpreted' (context_kernel)."""
        q = constrain(q, CONTEXT_AXES)
        k, v = (constrain(a.astype(q.dtype), KV_AXES) for a in (k, v))
        rate = self.dropout_rate if row_keys is not None else 0.0
        if rate:
            seeds = flash_attention.head_seeds(row_keys.reshape(-1), site, q.shape[2])
        else:
            seeds = jnp.zeros(q.shape[0:1] + q.shape[2:3], jnp.uint32)
        chunks = 2 * shards('seq')
        in_sequence = np.argsort(context_lib.chunk_order(chunks, chunks // 2))  # chunk ids

        def natural(x):  # gathered (batch, seq, ...) in the chunk order -> in sequence order
            x, rank = gather_context(x, 1)
            pieces = x.reshape(x.shape[0], chunks, -1, *x.shape[2:])[:, in_sequence]
            return pieces.reshape(x.shape), rank

        def flash(q, k, v, seeds, *segments):
            (k, rank), (v, _) = natural(k), natural(v)
            ids = natural(segments[0])[0] if segments else None
            size = q.shape[1] // 2
            out = [
                flash_attention.flash_attention(
                    q[:, i * size : (i + 1) * size],
                    k,
                    v,
                    seeds,
                    rate,
                    segment_ids=ids,
                    q_offset=chunk * size,
                    interpret=kernel == 'flash_interpreted',
                    generation=self.gpu_generation,
                )  # fmt: skip
                for i, chunk in enumerate((rank, chunks - 1 - rank))
            ]
            return jnp.concatenate(out, axis=1)

        args = (q, k, v, constrain(seeds, SEED_AXES))
        axes = (CONTEXT_AXES, KV_AXES, KV_AXES, SEED_AXES)
        if segment_ids is not None:
            args, axes = args + (segment_ids,), axes + (SEGMENT_AXES,)
        return constrain(local_call(flash, args, CONTEXT_AXES, args_axes=axes), CONTEXT_AXES)

    def cached(self, x, cache, index, order=None):
        """Attention of new tokens x (batch, new, embed) at positions index, index + 1, ...
        over every earlier position, for decoding with a KV cache.

        cache: (keys, values), each (batch, max_len, kv_heads, head_dim); the new tokens'
        keys and values (rotated by their positions under rope) are written at `index` and
        the updated cache is returned with the output. order: a prompt from position 0 in
        the chunk order, split over 'context' (cached_context).
        """
        if order is not None:
            return self.cached_context(x, cache, order)
        q, k, v = self.project_qkv(x, index + jnp.arange(x.shape[1]))
        keys, values = (
            jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1)
            for c, new in zip(cache, (k, v))
        )
        if self.kernel in ('cudnn', 'xla') and x.shape[1] == 1:  # one token: keys 0 .. index
            context = self.attend_fused(q, keys, values, visible_keys=index + 1)
            return self.project_out(context), (keys, values)
        # A prompt (several new tokens at once): the plain path, whose mask starts at index
        # (cuDNN's causal mask starts at key 0); the flash kernel takes whole sequences only,
        # and one new token's scores are one row: nothing to fuse.
        query_pos = index + jnp.arange(x.shape[1])
        visible = jnp.arange(keys.shape[1])[None, :] <= query_pos[:, None]
        return self.project_out(self.attend(q, keys, values, visible)), (keys, values)

    def cached_context(self, x, cache, order):
        """A prompt's prefill split over 'context' as training splits a sequence: x (batch, n,
        embed) in the chunk order (order (n,): the global position of each place,
        parallel/context.py), so each rank's queries are its two chunks, against the keys
        and values gathered over 'context' (context(): the flash kernel at each chunk's
        offset where it runs, else the plain path on (n / c) x n scores a rank). The keys
        and values go into the cache in sequence order from position 0."""
        q, k, v = self.project_qkv(x, order)
        rows = jnp.broadcast_to(jnp.asarray(order), x.shape[:2])
        context = self.context(q, k, v, None, 0, order=rows)
        in_sequence = np.argsort(order)
        keys, values = (
            jax.lax.dynamic_update_slice_in_dim(c, new[:, in_sequence].astype(c.dtype), 0, axis=1)
            for c, new in zip(cache, (k, v))
        )
        return self.project_out(context), (keys, values)
