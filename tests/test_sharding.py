"""Where every parameter and optimizer-state leaf lives (that the logits stay split over the
vocabulary: test_plan_hlo.py, from the compiled train and eval steps)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import support
from mtnlg_jax.model import gpt
from mtnlg_jax.train import state as state_lib

# Megatron's layout, written out by hand (not derived from the rule table it checks):
# column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out, vocab-parallel
# embedding; layer norms, output biases and positions replicated over 'tensor'; the stacked
# blocks split over 'stage' by layer (a no-op here: stage 1).
EXPECTED_COMPUTE_SPECS = {
    "['token_embed']": P('tensor', None),
    "['position_embed']": P(None, None),
    "['final_norm']['scale']": P(None),
    "['final_norm']['bias']": P(None),
    "['blocks']['attention']['qkv_kernel']": P('stage', None, None, 'tensor', None),
    "['blocks']['attention']['qkv_bias']": P('stage', None, 'tensor', None),
    "['blocks']['attention']['out_kernel']": P('stage', 'tensor', None, None),
    "['blocks']['attention']['out_bias']": P('stage', None),
    "['blocks']['mlp']['in_kernel']": P('stage', None, 'tensor'),
    "['blocks']['mlp']['in_bias']": P('stage', 'tensor'),
    "['blocks']['mlp']['out_kernel']": P('stage', 'tensor', None),
    "['blocks']['mlp']['out_bias']": P('stage', None),
    "['blocks']['ln_attn']['scale']": P('stage', None),
    "['blocks']['ln_attn']['bias']": P('stage', None),
    "['blocks']['ln_mlp']['scale']": P('stage', None),
    "['blocks']['ln_mlp']['bias']": P('stage', None),
}


def _zero(spec, shape, data, tensor):
    """The hand-written spec with 'data' on the first whole dimension it divides, else on the
    first tensor-split dimension that data x tensor divides."""
    axes = list(spec)
    for dim, size in enumerate(shape):
        if axes[dim] is None and size % data == 0:
            axes[dim] = 'data'
            return P(*axes)
    for dim, size in enumerate(shape):
        if axes[dim] == 'tensor' and size % (data * tensor) == 0:
            axes[dim] = ('tensor', 'data')
            return P(*axes)
    return P(*axes)


def _normalized(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.fixture(scope='module')
def state_and_setup():
    config = support.small_config(data=4, tensor=2)
    mesh, setup = support.layout(config)
    return state_lib.init_state(config, setup), setup


def test_compute_copy_follows_megatron_layout(state_and_setup):
    _, setup = state_and_setup
    specs = {
        jax.tree_util.keystr(path): sharding.spec
        for path, sharding in jax.tree_util.tree_leaves_with_path(setup.compute_shardings)
    }
    assert set(specs) == set(EXPECTED_COMPUTE_SPECS)
    for name, spec in specs.items():
        expected = EXPECTED_COMPUTE_SPECS[name]
        assert _normalized(spec, len(expected)) == tuple(expected), name


def test_master_weights_and_adam_moments_are_also_split_over_data(state_and_setup):
    state, _ = state_and_setup
    params = state['params']
    adam = state['opt_state'][1]  # chain: clip, adam, weight decay
    checked = 0
    for tree in (params, adam.mu, adam.nu):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = jax.tree_util.keystr(path)
            expected = _zero(EXPECTED_COMPUTE_SPECS[name], leaf.shape, data=4, tensor=2)
            assert _normalized(leaf.sharding.spec, leaf.ndim) == tuple(expected), name
            checked += 1
    assert checked == 3 * len(EXPECTED_COMPUTE_SPECS)
    # (layers 2, embed 64, mlp 256): 2 layers do not divide over data 4, so ZeRO splits embed.
    kernel = params['blocks']['mlp']['in_kernel']
    assert kernel.addressable_shards[0].data.shape == (2, 64 // 4, 256 // 2)
    # (layers 2, mlp 256): no whole dimension divides, so mlp is split over tensor x data.
    bias = params['blocks']['mlp']['in_bias']
    assert bias.sharding.spec == P('stage', ('tensor', 'data'))
    assert bias.addressable_shards[0].data.shape == (2, 256 // 8)


def test_rule_table_is_the_only_mesh_vocabulary():
    """The model speaks logical names only: no mesh axis name appears in model/."""
    import mtnlg_jax.model as model_pkg

    for path in model_pkg.__path__:
        for source in pathlib.Path(path).glob('*.py'):
            text = source.read_text()
            for axis in ("'data'", "'stage'", "'tensor'"):
                assert axis not in text, f'{source.name} names mesh axis {axis}'


def test_loss_of_logits_equals_reference_softmax_cross_entropy():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 7)), jnp.float32)
    labels = jnp.asarray([[0, 6, 3], [2, 2, 5]])
    expected = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(gpt.cross_entropy(logits, labels), expected, rtol=1e-6)
