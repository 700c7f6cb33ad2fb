"""The GPT forward for decoding with a KV cache: one path for inference, apart from training.

Training runs the block stack through `gpt.apply_blocks` (pipelined when mesh.stage > 1);
decoding needs each layer's keys and values of every earlier position, so it scans the same
stacked block parameters with that layer's slice of the cache alongside:

    cache = (keys, values), each (layers, batch, max_len, kv_heads, head_dim), split over
            kv_heads; under rope the keys are stored rotated by their positions; a row for
            every layer, the dense layers ahead of a mixture of experts (their own stack)
            first
    forward_cached(model, tokens (batch, new), cache, index)
        -> logits of the last new position (batch, vocab), cache with positions
           index .. index + new - 1 filled

A prompt goes in as one call (prefill), then one token per call.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from mtnlg_jax.parallel.rules import constrain

from mtnlg_jax.model.layers import attention_dims

CACHE_AXES = ('layers', 'batch', 'kv_seq', 'kv_heads', 'head_dim')


def init_cache(model_cfg, batch, max_len, dtype):
    """An empty cache for `batch` sequences of up to `max_len` positions."""
    _, kv_heads, head_dim = attention_dims(model_cfg)
    shape = (model_cfg.num_layers, batch, max_len, kv_heads, head_dim)
    return tuple(constrain(jnp.zeros(shape, dtype), CACHE_AXES) for _ in range(2))


def forward_cached(model, tokens, cache, index):
    """Logits (batch, vocab) after tokens (batch, new) at positions index .. index + new - 1,
    and the updated cache. The caller keeps index + new <= model.seq_len."""
    x = jnp.take(model.token_embed[...], tokens, axis=0)
    if model.position_embed is not None:  # rope: the blocks rotate by index, index + 1, ...
        table = model.position_embed[...]
        x = x + jax.lax.dynamic_slice_in_dim(table, index, tokens.shape[1])
    x = constrain(x, ('batch', 'seq', 'embed'))
    if model.dense_blocks is None:
        x, cache = _cached_stack(model.blocks, x, cache, index)
    else:  # the dense layers ahead of the experts hold the cache's first rows
        k = model.dense_layers
        x, dense = _cached_stack(model.dense_blocks, x, tuple(c[:k] for c in cache), index)
        x, rest = _cached_stack(model.blocks, x, tuple(c[k:] for c in cache), index)
        cache = tuple(jnp.concatenate(pair) for pair in zip(dense, rest))
    cache = tuple(constrain(c, CACHE_AXES) for c in cache)
    hidden = model.final_norm(x[:, -1:])
    return model.logits(hidden)[:, 0], cache


def _cached_stack(blocks, x, cache, index):
    """(x, cache) after a stack of blocks scanned over x with their layers' cache rows."""
    graphdef, stacked = nnx.split(blocks)

    def one_block(x, block_and_cache):
        params, keys, values = block_and_cache
        x, (keys, values) = nnx.merge(graphdef, params).cached(x, (keys, values), index)
        return x, (keys, values)

    return jax.lax.scan(one_block, x, (stacked, *cache))
