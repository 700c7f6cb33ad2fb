"""Invariants 1 and 2 of docs/design.md: every layout starts from the same parameters and
computes the loss and gradients of one device (fp32), step after step, with sequence
parallelism on (sp) and off."""

import numpy as np
import pytest

import support

LAYOUTS = [  # (data, stage, tensor, sequence_parallel)
    (8, 1, 1, False),
    (4, 1, 2, False),
    (2, 1, 4, False),
    (1, 1, 8, False),
    (4, 1, 2, True),
    (2, 1, 4, True),
    (1, 1, 8, True),
]
TRAJECTORY_LAYOUTS = LAYOUTS[:5]
# data 4 x tensor 2, sequence parallelism off and on: the dropout test's layouts below (the same
# micro-batches; initial parameters, loss and gradients against one device, dropout on)
GRADIENT_LAYOUTS = [layout for layout in LAYOUTS if layout[:3] != (4, 1, 2)]


@pytest.fixture(scope='module')
def one_device():
    config = support.small_config(data=1)
    batch = support.random_batches(1)[0]
    params, loss, grads = support.gradients(config, batch)
    losses, _ = support.train_losses(config, support.random_batches(10, seed=1))
    return dict(params=params, loss=loss, grads=grads, losses=losses)


@pytest.mark.parametrize('data,stage,tensor,sp', GRADIENT_LAYOUTS)
def test_initial_parameters_loss_and_gradients_match_one_device(
    one_device, data, stage, tensor, sp
):
    config = support.small_config(data, stage, tensor, sequence_parallel=sp)
    params, loss, grads = support.gradients(config, support.random_batches(1)[0])
    support.assert_trees_close(params, one_device['params'], atol=0.0)  # bit-identical
    np.testing.assert_allclose(loss, one_device['loss'], rtol=1e-6)
    support.assert_gradients_close(grads, one_device['grads'])


@pytest.mark.parametrize('data,stage,tensor,sp', TRAJECTORY_LAYOUTS)
def test_ten_step_losses_match_one_device(one_device, data, stage, tensor, sp):
    config = support.small_config(data, stage, tensor, sequence_parallel=sp)
    losses, _ = support.train_losses(config, support.random_batches(10, seed=1))
    assert losses[-1] < losses[0] - 0.05, 'the model should learn something in 10 steps'
    np.testing.assert_allclose(losses, one_device['losses'], atol=1e-4)


@pytest.mark.parametrize('sp', [False, True])
def test_dropout_masks_do_not_depend_on_the_layout(sp):
    """Dropout keys belong to sequences, not devices, micro-steps or sequence shards."""
    support.assert_dropout_does_not_depend_on_the_layout(
        dict(data=4, tensor=2, micro_steps=2, sequence_parallel=sp),
        dict(attention_dropout=0.1, hidden_dropout=0.1),
    )
