"""Small pieces the GPT blocks are made of: named parameters, layer norm, dropout.

Every parameter carries `logical_axes` metadata (its dimensions' logical names); the rule table
in parallel/rules.py alone turns those into mesh axes.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs, shape, logical_axes, std=None):
    """A parameter drawn from normal(0, std), or zeros when std is None."""
    if std is None:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=tuple(logical_axes))


def use(variable, dtype):
    """A parameter's value in the compute dtype, cast where it is used: the forward sees the
    same numbers whether the parameters arrive in fp32 or already cast, and when they arrive
    in fp32 their gradient is summed in fp32 over every use (e.g. a pipeline's iterations)."""
    return variable[...].astype(dtype)


class LayerNorm(nnx.Module):
    """Layer norm over `embed`, computed in fp32 whatever the compute dtype."""

    def __init__(self, hidden, epsilon):
        self.scale = nnx.Param(jnp.ones((hidden,), jnp.float32), logical_axes=('embed',))
        self.bias = nnx.Param(jnp.zeros((hidden,), jnp.float32), logical_axes=('embed',))
        self.epsilon = epsilon

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def dropout(x, rate, row_keys, site):
    """Inverted dropout whose mask depends only on each sequence's own key and the site.

    `row_keys` holds one PRNG key per sequence (shape: x's leading batch dimensions), derived
    from the step's seed and the sequence's index in the global batch, so the masks are the
    same whatever the mesh layout, the split into micro-steps or the pipeline schedule. `site`
    tells dropout sites of one forward apart. No-op when rate is 0 or row_keys is None.
    """
    if rate == 0.0 or row_keys is None:
        return x
    batch_shape, row_shape = x.shape[: row_keys.ndim], x.shape[row_keys.ndim :]
    keep = jax.vmap(
        lambda key: jax.random.bernoulli(jax.random.fold_in(key, site), 1.0 - rate, row_shape)
    )(row_keys.reshape(-1))
    return jnp.where(keep.reshape(batch_shape + row_shape), x / (1.0 - rate), 0).astype(x.dtype)
