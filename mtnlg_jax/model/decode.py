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

A prompt goes in as one call (prefill), then one token per call. Under context parallelism
(mesh.context > 1) the prefill takes the prompt in the chunk order and splits it over
'context' as training does (eval/generation.py); the tokens after it run as before.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtnlg_jax.parallel.rules import constrain

from mtnlg_jax.model.layers import attention_dims

CACHE_AXES = ('layers', 'batch', 'kv_seq', 'kv_heads', 'head_dim')


def init_cache(model_cfg, batch, max_len, dtype):
    """An empty cache for `batch` sequences of up to `max_len` positions."""
    _, kv_heads, head_dim = attention_dims(model_cfg)
    shape = (model_cfg.num_layers, batch, max_len, kv_heads, head_dim)
    return tuple(constrain(jnp.zeros(shape, dtype), CACHE_AXES) for _ in range(2))


def forward_cached(model, tokens, cache, index, order=None):
    """Logits (batch, vocab) after tokens (batch, new) at positions index .. index + new - 1,
    and the updated cache. The caller keeps index + new <= model.seq_len. order: a prompt
    from index 0 given in the chunk order of context parallelism (order (new,): the global
    position of each place; parallel/context.py), split over 'context' (Attention.cached)."""
    x = jnp.take(model.token_embed[...], tokens, axis=0)
    if model.position_embed is not None:  # rope: the blocks rotate by index, index + 1, ...
        table = model.position_embed[...]
        if order is None:
            x = x + jax.lax.dynamic_slice_in_dim(table, index, tokens.shape[1])
        else:
            x = x + table[jnp.asarray(order)]
    x = constrain(x, ('batch', 'seq', 'embed'))
    stack = functools.partial(_cached_stack, index=index, order=order)
    if model.dense_blocks is None:
        x, cache = stack(model.blocks, x, cache)
    else:  # the dense layers ahead of the experts hold the cache's first rows
        k = model.dense_layers
        x, dense = stack(model.dense_blocks, x, tuple(c[:k] for c in cache))
        x, rest = stack(model.blocks, x, tuple(c[k:] for c in cache))
        cache = tuple(jnp.concatenate(pair) for pair in zip(dense, rest))
    cache = tuple(constrain(c, CACHE_AXES) for c in cache)
    last = -1 if order is None else int(np.argmax(order))  # the last position's place
    hidden = model.final_norm(x[:, last:][:, :1])
    return model.logits(hidden)[:, 0], cache


def _cached_stack(blocks, x, cache, index, order):
    """(x, cache) after a stack of blocks scanned over x with their layers' cache rows."""
    graphdef, stacked = nnx.split(blocks)

    def one_block(x, block_and_cache):
        params, keys, values = block_and_cache
        block = nnx.merge(graphdef, params)
        x, (keys, values) = block.cached(x, (keys, values), index, order)
        return x, (keys, values)

    return jax.lax.scan(one_block, x, (stacked, *cache))
