"""One pre-LN transformer block: x + Attention(LN(x)), then x + MLP(LN(x)).

Tensor parallelism (Megatron) comes from the logical names alone: QKV and MLP-in are split by
columns (`heads`, `mlp`), attention-out and MLP-out by rows, so each block needs one
all-reduce after attention and one after the MLP, inserted by XLA. The residual stream (layer
norms, dropout, residual adds) names its sequence axis `residual_seq`: under sequence
parallelism the rule table splits it over tensor, and each all-reduce becomes a reduce-scatter
plus an all-gather before the next column-parallel matmul (see parallel/rules.py).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mtnlg_jax.config import ConfigError
from mtnlg_jax.model import flash_attention
from mtnlg_jax.model.layers import LayerNorm, dropout, param, use
from mtnlg_jax.parallel.rules import constrain, local_call

# Names of the values `model.remat = 'selective'` keeps: every matmul output. The attention
# core (scores, softmax, dropout) is recomputed in the backward pass, as in Megatron's
# selective recompute (arXiv 2205.05198): cheap FLOPs, large memory.
SELECTIVE_SAVED = ('qkv', 'context', 'attn_out', 'mlp_in', 'mlp_out')

# The largest head dimension of cuDNN's flash attention by compute capability major (JAX 0.10:
# 128 before Hopper, 256 from it); MT-NLG's 160 fits H100's, not A100's. The Pallas flash
# kernel (model/flash_attention.py) pads the head dimension to a power of two, up to 256.
CUDNN_MAX_HEAD_DIM = {8: 128, 9: 256}
CONTEXT_AXES = ('batch', 'seq', 'heads', 'head_dim')
SEED_AXES = ('batch', 'heads')
SEGMENT_AXES = ('batch', 'seq')


def same_segment(segment_ids):
    """(batch, 1, seq, seq) bool: query and key in the same segment (broadcast over heads)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def attention_kernel(cfg, device=None):
    """What Attention runs under model.attention on `device` (the mesh's first; None: the CPU):

        'cudnn'  jax.nn.dot_product_attention's cuDNN flash attention (a GPU; no dropout)
        'flash'  the Pallas flash kernel (model/flash_attention.py) as Triton on a GPU, where
                 cuDNN cannot (A100 with head dim 160, attention dropout)
        'flash_interpreted'  the same kernel interpreted, elsewhere (`flash` asked for by
                 name, or `fused` with dropout, on a CPU: the tests)
        'xla'    jax.nn.dot_product_attention on a CPU (`fused` without dropout: the tests)
        'plain'  einsums around the materialised (seq x seq) scores

    auto takes the first of cudnn, flash, plain that can run; fused the first of cudnn, flash
    and refuses what neither can (one ConfigError naming why)."""
    choice = cfg.get('attention', 'plain')
    on_gpu = device is not None and device.platform == 'gpu'
    head_dim = cfg.hidden // cfg.heads
    flash_refuses = flash_attention.refusal(cfg.seq_len, head_dim)
    if choice == 'plain':
        return choice
    if choice == 'flash' and flash_refuses:
        raise ConfigError('model.attention', f'the Pallas flash kernel cannot take {flash_refuses}')
    if choice == 'flash':
        return 'flash' if on_gpu else 'flash_interpreted'
    if not on_gpu:
        if choice == 'auto':
            return 'plain'
        return 'flash_interpreted' if cfg.attention_dropout > 0 else 'xla'
    major = int(str(getattr(device, 'compute_capability', '8.0')).split('.')[0])
    half = cfg.compute_dtype in ('bfloat16', 'float16')
    limit = CUDNN_MAX_HEAD_DIM.get(major, 256 if major > 9 else 0)
    cudnn_refuses = [
        why
        for failed, why in (
            (not half, f'{cfg.compute_dtype} compute'),
            (head_dim > limit or head_dim % 8, f'head dim {head_dim} (at most {limit} here)'),
            (cfg.attention_dropout > 0, f'attention dropout {cfg.attention_dropout}'),
        )
        if failed
    ]
    if not cudnn_refuses:
        return 'cudnn'
    if half and not flash_refuses:
        return 'flash'
    if choice == 'fused':
        raise ConfigError(
            'model.attention',
            f'no fused kernel runs this: cuDNN cannot fuse {", ".join(cudnn_refuses)}; the '
            f'Pallas flash kernel needs bf16 or fp16 compute and cannot take '
            f'{flash_refuses or cfg.compute_dtype + " compute"}',
        )
    return 'plain'


# Dropout sites of one block, told apart in the per-sequence keys.
_ATTN_PROBS, _ATTN_RESIDUAL, _MLP_RESIDUAL = range(3)
SITES_PER_BLOCK = 3


class Attention(nnx.Module):
    """Causal multi-head self-attention; softmax in fp32."""

    def __init__(self, cfg, rngs, kernel='plain'):
        heads, hidden = cfg.heads, cfg.hidden
        head_dim = hidden // heads
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv_kernel = param(
            rngs, (hidden, 3, heads, head_dim), ('embed', 'qkv', 'heads', 'head_dim'), cfg.init_std
        )
        self.qkv_bias = param(rngs, (3, heads, head_dim), ('qkv', 'heads', 'head_dim'))
        self.out_kernel = param(
            rngs, (heads, head_dim, hidden), ('heads', 'head_dim', 'embed'), out_std
        )
        self.out_bias = param(rngs, (hidden,), ('embed',))
        self.dropout_rate = cfg.attention_dropout
        self.dtype = cfg.compute_dtype
        self.kernel = kernel  # attention_kernel()'s choice

    def project_qkv(self, x):
        """(batch, seq, embed) -> (batch, seq, 3, heads, head_dim), split over heads."""
        kernel, bias = use(self.qkv_kernel, self.dtype), use(self.qkv_bias, self.dtype)
        qkv = jnp.einsum('bse,ethd->bsthd', x, kernel) + bias
        return checkpoint_name(constrain(qkv, ('batch', 'seq', 'qkv', 'heads', 'head_dim')), 'qkv')

    def attend(self, q, k, v, visible, row_keys=None, site=0):
        """Context of queries q over keys k and values v (batch, len, heads, head_dim);
        visible: (q_len, k_len) bool, which keys each query may see."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        scores = constrain(scores, ('batch', 'heads', 'seq', 'kv_seq'))
        probs = jax.nn.softmax(scores, axis=-1)
        probs = dropout(probs, self.dropout_rate, row_keys, site).astype(q.dtype)
        context = jnp.einsum('bhqk,bkhd->bqhd', probs, v.astype(q.dtype))
        return checkpoint_name(constrain(context, CONTEXT_AXES), 'context')

    def attend_fused(self, q, k, v, visible_keys=None, row_keys=None, site=0, segment_ids=None):
        """The same context in one kernel (self.kernel): no (seq x seq) scores are kept, the
        backward recomputes them; q, k, v and the context in the compute dtype. Causal, or
        with visible_keys (a scalar, decoding): keys 0 .. visible_keys - 1 for every query;
        segment_ids (batch, seq): causal within each segment only (packed documents).
        Each device runs the kernel on its own batch rows and heads (rules.local_call:
        cuDNN's partitioning rule fails inside the pipeline). The flash kernel applies
        attention dropout from per-(sequence, head) seeds drawn from row_keys."""
        q, k, v = (constrain(a.astype(q.dtype), CONTEXT_AXES) for a in (q, k, v))
        if self.kernel in ('flash', 'flash_interpreted'):
            if segment_ids is not None:
                raise NotImplementedError('the Pallas flash kernel takes no segment ids yet')
            rate = self.dropout_rate if row_keys is not None else 0.0
            if rate:
                seeds = flash_attention.head_seeds(row_keys.reshape(-1), site, q.shape[2])
            else:
                seeds = jnp.zeros(q.shape[0:1] + q.shape[2:3], jnp.uint32)
            interpret = self.kernel == 'flash_interpreted'  # decided by the mesh's device
            context = local_call(
                lambda q, k, v, seeds: flash_attention.flash_attention(
                    q, k, v, seeds, rate, interpret
                ),
                (q, k, v, constrain(seeds, SEED_AXES)),
                CONTEXT_AXES,
                args_axes=(CONTEXT_AXES,) * 3 + (SEED_AXES,),
            )
            return checkpoint_name(constrain(context, CONTEXT_AXES), 'context')

        def kernel(q, k, v, *segments_or_visible):
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
                implementation=self.kernel,
            )

        if segment_ids is not None:
            args, axes = (q, k, v, segment_ids), (CONTEXT_AXES,) * 3 + (SEGMENT_AXES,)
            context = local_call(kernel, args, CONTEXT_AXES, args_axes=axes)
        else:
            extra = () if visible_keys is None else (jnp.asarray(visible_keys, jnp.int32),)
            context = local_call(kernel, (q, k, v), CONTEXT_AXES, extra)
        return checkpoint_name(constrain(context, CONTEXT_AXES), 'context')

    def project_out(self, context):
        """(batch, seq, heads, head_dim) -> (batch, seq, embed): row parallel, one all-reduce
        (sequence parallel: a reduce-scatter onto the residual stream's sequence shards)."""
        kernel, bias = use(self.out_kernel, self.dtype), use(self.out_bias, self.dtype)
        out = jnp.einsum('bqhd,hde->bqe', context, kernel) + bias
        return checkpoint_name(constrain(out, ('batch', 'residual_seq', 'embed')), 'attn_out')

    def __call__(self, x, row_keys, site_base, segment_ids=None):
        """segment_ids (batch, seq) or None: with them a query sees only the earlier keys of
        its own segment (packed documents, data/packing.py)."""
        qkv = self.project_qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        site = site_base + _ATTN_PROBS
        if self.kernel != 'plain':
            context = self.attend_fused(
                q, k, v, row_keys=row_keys, site=site, segment_ids=segment_ids
            )
            return self.project_out(context)
        seq = x.shape[1]
        visible = jnp.tril(jnp.ones((seq, seq), bool))
        if segment_ids is not None:  # fused by XLA into the select on the scores
            visible = visible & same_segment(segment_ids)
        context = self.attend(q, k, v, visible, row_keys, site)
        return self.project_out(context)

    def cached(self, x, cache, index):
        """Attention of new tokens x (batch, new, embed) at positions index, index + 1, ...
        over every earlier position, for decoding with a KV cache.

        cache: (keys, values), each (batch, max_len, heads, head_dim); the new tokens' keys
        and values are written at `index` and the updated cache is returned with the output.
        """
        qkv = self.project_qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
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


class MLP(nnx.Module):
    """hidden -> ffn_hidden (GeLU, tanh approximation as GPT-2) -> hidden."""

    def __init__(self, cfg, rngs):
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.in_kernel = param(rngs, (cfg.hidden, cfg.ffn_hidden), ('embed', 'mlp'), cfg.init_std)
        self.in_bias = param(rngs, (cfg.ffn_hidden,), ('mlp',))
        self.out_kernel = param(rngs, (cfg.ffn_hidden, cfg.hidden), ('mlp', 'embed'), out_std)
        self.out_bias = param(rngs, (cfg.hidden,), ('embed',))
        self.dtype = cfg.compute_dtype

    def __call__(self, x):
        h = jnp.einsum('bse,ef->bsf', x, use(self.in_kernel, self.dtype)) + use(
            self.in_bias, self.dtype
        )
        h = checkpoint_name(constrain(h, ('batch', 'seq', 'mlp')), 'mlp_in')
        h = jax.nn.gelu(h, approximate=True)
        out = jnp.einsum('bsf,fe->bse', h, use(self.out_kernel, self.dtype)) + use(
            self.out_bias, self.dtype
        )
        return checkpoint_name(constrain(out, ('batch', 'residual_seq', 'embed')), 'mlp_out')


class Block(nnx.Module):
    def __init__(self, cfg, rngs, attention_kernel='plain'):
        self.ln_attn = LayerNorm(cfg.hidden, cfg.layer_norm_epsilon)
        self.attention = Attention(cfg, rngs, attention_kernel)
        self.ln_mlp = LayerNorm(cfg.hidden, cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, rngs)
        self.hidden_dropout = cfg.hidden_dropout

    def __call__(self, x, row_keys, layer, segment_ids=None):
        """x: (batch, seq, embed); layer: this block's index, for distinct dropout masks;
        segment_ids: (batch, seq) packed documents' ids, or None."""
        site = layer * SITES_PER_BLOCK
        h = self.attention(self.ln_attn(x), row_keys, site, segment_ids)
        x = x + dropout(h, self.hidden_dropout, row_keys, site + _ATTN_RESIDUAL)
        h = self.mlp(self.ln_mlp(x))
        x = x + dropout(h, self.hidden_dropout, row_keys, site + _MLP_RESIDUAL)
        return constrain(x, ('batch', 'residual_seq', 'embed'))

    def cached(self, x, cache, index):
        """The block on new tokens at positions index, ... with a KV cache (no dropout: for
        inference); returns (x, updated cache). See Attention.cached."""
        h, cache = self.attention.cached(self.ln_attn(x), cache, index)
        x = x + h
        x = x + self.mlp(self.ln_mlp(x))
        return constrain(x, ('batch', 'seq', 'embed')), cache
