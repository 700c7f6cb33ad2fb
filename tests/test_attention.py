"""Fused attention (model.attention = fused: jax.nn.dot_product_attention, cuDNN's flash attention
on GPUs) against the plain einsums: the same loss and gradients per leaf, the same decoding;
which kernel a config gets where; and what is refused."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import block, gpt
from mtnlg_jax.model.decode import forward_cached, init_cache

A100 = types.SimpleNamespace(platform='gpu', compute_capability='8.0')
H100 = types.SimpleNamespace(platform='gpu', compute_capability='9.0')
CPU = types.SimpleNamespace(platform='cpu')


def _model_cfg(attention, **overrides):
    return support.small_config(attention=attention, **overrides).model


def _loss_and_grads(cfg):
    """Loss and parameter gradients of one batch through the whole GPT, on one device."""
    graphdef, params, _ = gpt.split(gpt.create(cfg, 0))
    tokens = jnp.asarray(support.random_batches(1)[0][:4], jnp.int32)

    def loss(p):
        total, count = gpt.loss_sum(gpt.merge(graphdef, p), tokens)
        return total / count

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize('dtype, relative', [('float32', 1e-5), ('bfloat16', 3e-2)])
def test_fused_attention_gives_the_plain_loss_and_gradients(dtype, relative):
    """Causal attention in one call (on this CPU, XLA's implementation of the call cuDNN
    serves on GPUs) against einsums around the masked fp32 scores: the loss, and every
    parameter's gradient per leaf relative to its scale. bf16: both round differently."""
    fused_loss, fused = _loss_and_grads(_model_cfg('fused', compute_dtype=dtype))
    plain_loss, plain = _loss_and_grads(_model_cfg('plain', compute_dtype=dtype))
    np.testing.assert_allclose(fused_loss, plain_loss, rtol=relative)
    support.assert_within_leaf_scale(fused, plain, relative, what='gradient')


def test_the_plain_path_is_causal_and_so_is_the_fused_one():
    """A later token cannot change an earlier position's output, on either path: the fused
    kernel's mask is the causal one, not none."""
    for attention in ('fused', 'plain'):
        model = gpt.create(_model_cfg(attention), 0)
        tokens = jnp.asarray(support.random_batches(1)[0][:2, :16], jnp.int32)
        changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % support.VOCAB)
        first, second = model(tokens), model(changed)
        np.testing.assert_allclose(first[:, :-1], second[:, :-1], atol=1e-6)
        assert np.abs(first[:, -1] - second[:, -1]).max() > 1e-4


def test_decoding_with_the_fused_kernel_matches_plain_decoding():
    """The KV-cache path: a prompt (plain on both), then tokens one at a time (the fused
    kernel over keys 0 .. index)."""
    logits = {}
    for attention in ('fused', 'plain'):
        cfg = _model_cfg(attention)
        model = gpt.create(cfg, 0)
        cache = init_cache(cfg, 2, cfg.seq_len, jnp.float32)
        prompt = jnp.asarray(support.random_batches(1)[0][:2, :8], jnp.int32)
        out, cache = forward_cached(model, prompt, cache, 0)
        steps = [out]
        for index in range(8, 12):
            out, cache = forward_cached(model, jnp.argmax(out, -1)[:, None], cache, index)
            steps.append(out)
        logits[attention] = np.stack(steps)
    np.testing.assert_allclose(logits['fused'], logits['plain'], atol=2e-5)


@pytest.mark.parametrize(
    'overrides, device, kernel',
    [
        (dict(compute_dtype='bfloat16'), A100, 'cudnn'),  # head dim 8
        (dict(compute_dtype='bfloat16'), CPU, 'plain'),
        (dict(compute_dtype='float32'), A100, 'plain'),
        (dict(compute_dtype='bfloat16', attention_dropout=0.1), A100, 'plain'),
        (dict(compute_dtype='bfloat16', hidden=8 * 160), A100, 'plain'),  # MT-NLG's head dim
        (dict(compute_dtype='bfloat16', hidden=8 * 160), H100, 'cudnn'),
        (dict(compute_dtype='bfloat16', attention='plain'), H100, 'plain'),
        (dict(compute_dtype='float32', attention='fused'), CPU, 'xla'),
    ],
)
def test_which_kernel_a_config_gets(overrides, device, kernel):
    cfg = _model_cfg(overrides.pop('attention', 'auto'), **overrides)
    assert block.attention_kernel(cfg, device) == kernel


def test_fused_attention_with_dropout_or_where_cudnn_cannot_is_refused():
    config = support.small_config(attention='fused').copy_and_resolve_references()
    config.model.attention_dropout = 0.1
    with pytest.raises(config_lib.ConfigError, match='model.attention: fused attention applies'):
        config_lib.resolve(config, 1)
    with pytest.raises(config_lib.ConfigError, match='cuDNN cannot fuse float32 compute'):
        block.attention_kernel(_model_cfg('fused'), A100)
