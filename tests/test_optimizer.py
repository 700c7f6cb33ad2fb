"""The paper's recipe: token-based warmup + cosine schedule, decay only on kernels/embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.train.optimizer import learning_rate_schedule, make_optimizer, weight_decay_mask


def _opt(**overrides):
    """configs/mtnlg_530b.py's optimizer section (the paper's recipe), with overrides."""
    opt = config_lib.load('configs/mtnlg_530b.py').optimizer
    opt.update(overrides)
    return opt


def test_schedule_in_tokens_matches_mtnlg():
    lr = learning_rate_schedule(_opt())
    assert float(lr(0.0)) == 0.0
    np.testing.assert_allclose(lr(5e8), 2.5e-5, rtol=1e-4)  # halfway through warmup
    np.testing.assert_allclose(lr(1e9), 5e-5, rtol=1e-4)  # peak at 1 B tokens
    midpoint = 1e9 + (340e9 - 1e9) / 2  # cosine halfway: mean of peak and floor
    np.testing.assert_allclose(lr(midpoint), (5e-5 + 5e-6) / 2, rtol=1e-3)
    np.testing.assert_allclose(lr(340e9), 5e-6, rtol=1e-4)  # 10 % of peak
    np.testing.assert_allclose(lr(400e9), 5e-6, rtol=1e-4)  # and stays there


def test_weight_decay_skips_biases_and_layer_norms():
    params = {
        'token_embed': 0,
        'blocks': {'mlp': {'in_kernel': 0, 'in_bias': 0}, 'ln_mlp': {'scale': 0, 'bias': 0}},
    }
    mask = weight_decay_mask(params)
    assert mask == {
        'token_embed': True,
        'blocks': {
            'mlp': {'in_kernel': True, 'in_bias': False},
            'ln_mlp': {'scale': False, 'bias': False},
        },
    }


def test_zero_gradient_step_decays_kernels_only():
    params = {'mlp': {'in_kernel': jnp.ones((2, 2)), 'in_bias': jnp.ones((2,))}}
    tx = make_optimizer(_opt(weight_decay=0.5))
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    np.testing.assert_allclose(updates['mlp']['in_kernel'], 0.5)
    np.testing.assert_allclose(updates['mlp']['in_bias'], 0.0)


@pytest.mark.parametrize('scale', [0.1, 10.0])
def test_gradients_are_clipped_to_global_norm_before_adam(scale):
    """Adam's first moment after one update is (1 - b1) x the clipped gradient."""
    params = {'w_kernel': jnp.zeros((4,))}
    grads = {'w_kernel': jnp.full((4,), scale)}  # global norm 2 x scale
    tx = make_optimizer(_opt(clip_norm=1.0))
    _, state = tx.update(grads, tx.init(params), params)
    clipped = scale * min(1.0, 1.0 / (2 * scale))
    np.testing.assert_allclose(state[1].mu['w_kernel'], (1 - 0.9) * clipped, rtol=1e-6)
