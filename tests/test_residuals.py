"""A VJP taken apart (parallel/residuals.py): the kept residuals hold no parameter, and the VJP
joined again with the parameters gives jax.vjp's gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from mtnlg_jax.parallel.residuals import join_vjp, split_vjp


def test_kept_residuals_leave_the_parameters_out_and_join_back_to_the_same_vjp():
    def layer(params, x):
        return jnp.tanh(x @ params['w']) @ params['v']

    params = {'w': jnp.arange(12.0).reshape(3, 4) / 10, 'v': jnp.ones((4, 2))}
    x = jnp.linspace(-1, 1, 6).reshape(2, 3)

    def check(params, x):
        y, kept, layout = split_vjp(layer, params, x)
        shapes = {leaf.shape for leaf in kept}
        assert (3, 4) not in shapes and (4, 2) not in shapes  # no weight is kept
        cotangent = jnp.ones_like(y)
        return join_vjp(layout, kept, params)(cotangent), jax.vjp(layer, params, x)[1](cotangent)

    joined, reference = jax.jit(check)(params, x)
    for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
