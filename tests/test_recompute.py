"""model.remat changes what the backward pass keeps, never what it computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.train import step as step_lib


def _temp_bytes(config):
    mesh, setup = support.layout(config)
    batch = support.random_batches(1)[0].astype(np.int32)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 1), mesh)
        compiled = (
            jax.jit(
                lambda p, t, r: step_lib.accumulate_gradients(config, setup, p, t, r, jnp.int32(0))
            )
            .lower(state['params'], tokens, rows)
            .compile()
        )
    return compiled.memory_analysis().temp_size_in_bytes


# selective with model.remat_recompute: the attention's input and output projections made
# again (what a layer keeps then: tests/test_plan_compiled.py)
LEANER = dict(remat='selective', remat_recompute='qkv,attn_out')
POLICIES = {'full': dict(remat='full'), 'selective': dict(remat='selective'), 'leaner': LEANER}


@pytest.mark.parametrize('policy', sorted(POLICIES))
def test_recompute_gives_the_same_gradients(policy):
    batch = support.random_batches(1)[0]
    _, loss, grads = support.gradients(support.small_config(data=2, tensor=2), batch)
    _, loss_remat, grads_remat = support.gradients(
        support.small_config(data=2, tensor=2, **POLICIES[policy]), batch
    )
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
    # Per leaf against its own scale too (measured: 2.5e-7 of it at most), not only 1e-6.
    support.assert_gradients_close(grads_remat, grads, atol=1e-6)


def test_full_recompute_keeps_less_than_none_and_selective_in_between():
    sizes = {
        policy: _temp_bytes(support.small_config(micro_steps=1, num_layers=4, remat=policy))
        for policy in ('none', 'selective', 'full')
    }
    assert sizes['full'] < sizes['selective'] < sizes['none'], sizes


@pytest.mark.parametrize(
    'remat,names,says',
    [('selective', 'qkv,softmax', 'softmax is not one of'), ('full', 'qkv', 'model.remat=full')],
)
def test_recompute_names_are_checked_naming_the_key(remat, names, says):
    with pytest.raises(config_lib.ConfigError, match=f'model.remat_recompute: .*{says}'):
        support.small_config(remat=remat, remat_recompute=names)  # resolved there


# model.remat_offload: GeLU's MLP input held in host memory, or SwiGLU's gate alone (its up
# kept on the device: two slot kinds, one of them hosted). Unpipelined, JAX's offloading
# policy moves it; through the 1F1B table, the engine moves its residual slots
# (parallel/offload.py), read by a whole backward (1f1b) or by B of a split one (zbh1); the
# reducing and gathering ticks: test_pipeline.py's interleaved layout with the key.
SWIGLU = dict(mlp='swiglu', position='rope', bias=False)
OFFLOADED = {
    'unpipelined': (dict(), 'mlp_in'),
    '1f1b': (dict(stage=2, micro_steps=4), 'mlp_in'),
    'zbh1': (dict(stage=2, micro_steps=4, schedule='zbh1'), 'mlp_in'),
    'swiglu-gate-1f1b': (dict(stage=2, micro_steps=4, **SWIGLU), 'mlp_gate'),
}


@pytest.mark.parametrize('layout', sorted(OFFLOADED))
def test_offloaded_residuals_give_the_same_gradients(layout):
    batch = support.random_batches(1)[0]
    layout, names = OFFLOADED[layout]
    kwargs = dict(data=1, tensor=2, remat='selective', **layout)
    _, loss, grads = support.gradients(support.small_config(**kwargs), batch)
    config = support.small_config(remat_offload=names, **kwargs)
    _, loss_offloaded, grads_offloaded = support.gradients(config, batch)
    np.testing.assert_allclose(loss_offloaded, loss, rtol=1e-6)
    support.assert_gradients_close(grads_offloaded, grads, atol=1e-6)


def _lowered_for_gpus(config):
    """The step's StableHLO as lowered for CUDA (a CPU's lowering of a move to the host is a
    no-op; nothing is compiled)."""
    mesh, setup = support.layout(config)
    batch = support.random_batches(1)[0].astype(np.int32)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 2), mesh)
        step = lambda p, t, r: step_lib.accumulate_gradients(config, setup, p, t, r, jnp.int32(0))  # noqa: E731
        traced = jax.jit(step).trace(state['params'], tokens, rows)
        return traced.lower(lowering_platforms=('cuda',)).as_text()


def test_offloaded_residuals_are_placed_in_host_memory_by_the_engine():
    """The 1F1B engine's residual slots of the named output are a pinned-host buffer, moved
    outside the forward's conditional (XLA:GPU computes a slot written inside one on the
    CPU); without the key nothing is placed on the host."""
    kwargs = dict(stage=2, micro_steps=2, remat='selective')
    plain = _lowered_for_gpus(support.small_config(**kwargs))
    offloaded = _lowered_for_gpus(support.small_config(remat_offload='mlp_in', **kwargs))
    assert 'pinned_host' not in plain
    # the slots' buffer and a forward's write to it; the backward's read back to the device
    assert offloaded.count('pinned_host') == 2, offloaded.count('pinned_host')
    assert offloaded.count('annotate_device_placement') == 3


@pytest.mark.parametrize(
    'recompute,names,says',
    [
        ('qkv', 'mlp_in,softmax', 'softmax is not one of'),
        ('qkv', 'qkv', 'qkv is made again'),
        ('mlp_in', 'mlp_up', 'mlp_up is made again'),  # 'mlp_in' is SwiGLU's gate and up
    ],
)
def test_offloaded_names_are_checked_naming_the_key(recompute, names, says):
    with pytest.raises(config_lib.ConfigError, match=f'model.remat_offload: .*{says}'):
        support.small_config(
            remat='selective', remat_recompute=recompute, remat_offload=names, **SWIGLU
        )


def test_swiglu_projection_names_are_refused_for_gelu():
    with pytest.raises(config_lib.ConfigError, match="model.remat_recompute: mlp_gate names a Sw"):
        support.small_config(remat='selective', remat_recompute='mlp_gate')
