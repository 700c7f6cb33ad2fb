"""bf16 compute on fp32 master weights: fp32 state, fp32 loss, a loss close to fp32's."""

import jax
import jax.numpy as jnp
import numpy as np

import support


def test_bfloat16_compute_keeps_fp32_state_and_tracks_fp32_loss():
    batches = support.random_batches(3)
    losses32, state32 = support.train_losses(support.small_config(data=2, tensor=2), batches)
    losses16, state16 = support.train_losses(
        support.small_config(data=2, tensor=2, compute_dtype='bfloat16'), batches
    )
    for leaf in jax.tree.leaves(state16['params']) + jax.tree.leaves(state16['opt_state'][1].mu):
        assert leaf.dtype == jnp.float32
    np.testing.assert_allclose(losses16, losses32, atol=2e-2)
    assert not np.allclose(losses16, losses32, rtol=0, atol=1e-6), 'bf16 compute should round'
