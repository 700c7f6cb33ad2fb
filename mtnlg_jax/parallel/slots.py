"""A stage's slot buffers and fp32 accumulators, as the engine's ticks update them: a slot read
and written in place (`read`, `write`), zero gradients of a tree (`zeros`), an add in fp32
(`add`) and one skipped in place under a predicate (`add_unless`)."""

import jax
import jax.numpy as jnp


def read(buffer, slot):
    return jax.lax.dynamic_index_in_dim(buffer, slot, 0, False)


def write(buffer, slot, arrived, value):
    """buffer[slot] = value where `arrived`, else as it was."""
    kept = jnp.where(arrived, value, jax.lax.dynamic_index_in_dim(buffer, slot, 0, False))
    return jax.lax.dynamic_update_index_in_dim(buffer, kept, slot, 0)


def zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def add(acc, grads):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def add_unless(skip, acc, grads, plus=None):
    """acc + grads in fp32 (or plus(acc, grads)), or acc as it was where `skip`: in place
    either way. The pass-through is the conditional's true branch: XLA:GPU copies one that is
    its false."""
    return jax.lax.cond(skip, lambda a, _: a, plus or add, acc, grads)
