"""k accumulated micro-steps compute what one step on the whole batch computes."""

import functools

import jax
import numpy as np
import pytest

import support


@functools.cache
def _whole_batch_step():
    """(loss, gradients) of one device's step on the whole batch in one micro-step."""
    whole = support.small_config(micro_steps=1)
    assert whole.train.micro_steps == 1
    return support.gradients(whole, support.random_batches(1)[0])[1:]


@pytest.mark.parametrize('data,tensor,sp', [(1, 1, False), (4, 2, True)])
def test_accumulated_micro_steps_equal_one_whole_batch_step(data, tensor, sp):
    """4 micro-steps on one device and over data 4 x tensor 2 (sequence parallel): one
    device's whole-batch step (one reference for both)."""
    batch = support.random_batches(1)[0]
    accumulated = support.small_config(
        data=data, tensor=tensor, micro_steps=4, sequence_parallel=sp
    )
    assert accumulated.train.micro_steps == 4
    loss_whole, grads_whole = _whole_batch_step()
    _, loss_accumulated, grads_accumulated = support.gradients(accumulated, batch)
    np.testing.assert_allclose(loss_accumulated, loss_whole, rtol=1e-6)
    support.assert_gradients_close(grads_accumulated, grads_whole)


def test_accumulated_training_follows_whole_batch_training():
    # After 5 Adam steps: the losses, and each parameter leaf's update against its own size
    # (an absolute bound failed on another CPU: Adam turns float noise in near-zero
    # gradients into parameter differences; support.assert_updates_close says why).
    batches = support.random_batches(5, seed=2)
    whole = support.small_config(micro_steps=1)
    losses_whole, state_whole = support.train_losses(whole, batches)
    losses_accumulated, state_accumulated = support.train_losses(
        support.small_config(micro_steps=8), batches
    )
    np.testing.assert_allclose(losses_accumulated, losses_whole, rtol=1e-5)
    support.assert_updates_close(
        jax.device_get(state_accumulated['params']),
        jax.device_get(state_whole['params']),
        support.initial_params(whole),
    )
