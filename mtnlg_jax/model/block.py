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

from mtnlg_jax.model.layers import LayerNorm, dropout, param, use
from mtnlg_jax.parallel.rules import constrain

# Names of the values `model.remat = 'selective'` keeps: every matmul output. The attention
# core (scores, softmax, dropout) is recomputed in the backward pass, as in Megatron's
# selective recompute (arXiv 2205.05198): cheap FLOPs, large memory.
SELECTIVE_SAVED = ('qkv', 'context', 'attn_out', 'mlp_in', 'mlp_out')

# Dropout sites of one block, told apart in the per-sequence keys.
_ATTN_PROBS, _ATTN_RESIDUAL, _MLP_RESIDUAL = range(3)
SITES_PER_BLOCK = 3


class Attention(nnx.Module):
    """Causal multi-head self-attention; softmax in fp32."""

    def __init__(self, cfg, rngs):
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
        return checkpoint_name(constrain(context, ('batch', 'seq', 'heads', 'head_dim')), 'context')

    def project_out(self, context):
        """(batch, seq, heads, head_dim) -> (batch, seq, embed): row parallel, one all-reduce
        (sequence parallel: a reduce-scatter onto the residual stream's sequence shards)."""
        kernel, bias = use(self.out_kernel, self.dtype), use(self.out_bias, self.dtype)
        out = jnp.einsum('bqhd,hde->bqe', context, kernel) + bias
        return checkpoint_name(constrain(out, ('batch', 'residual_seq', 'embed')), 'attn_out')

    def __call__(self, x, row_keys, site_base):
        qkv = self.project_qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        seq = x.shape[1]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        context = self.attend(q, k, v, causal, row_keys, site_base + _ATTN_PROBS)
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
    def __init__(self, cfg, rngs):
        self.ln_attn = LayerNorm(cfg.hidden, cfg.layer_norm_epsilon)
        self.attention = Attention(cfg, rngs)
        self.ln_mlp = LayerNorm(cfg.hidden, cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, rngs)
        self.hidden_dropout = cfg.hidden_dropout

    def __call__(self, x, row_keys, layer):
        """x: (batch, seq, embed); layer: this block's index, for distinct dropout masks."""
        site = layer * SITES_PER_BLOCK
        h = self.attention(self.ln_attn(x), row_keys, site)
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
