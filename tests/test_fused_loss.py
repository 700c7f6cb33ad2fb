"""The fused output layer + cross-entropy (model/loss.py) against autodiff of the plain one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from mtnlg_jax.model import gpt, loss

VOCAB, PADDED, HIDDEN = 37, 40, 16


def _inputs(seq=12, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(keys[0], (3, seq, HIDDEN))
    embed = jax.random.normal(keys[1], (PADDED, HIDDEN))
    labels = jax.random.randint(keys[2], (3, seq), 0, VOCAB)
    return hidden, embed, labels


def _plain_loss(hidden, embed, labels):
    """Autodiff's way: the whole (batch, seq, padded vocab) logits, padding at -inf."""
    logits = jnp.einsum('bse,ve->bsv', hidden, embed)
    logits = jnp.where(jnp.arange(PADDED) < VOCAB, logits, -jnp.inf)
    return gpt.cross_entropy(logits, labels).sum()


@pytest.mark.parametrize('chunks', [1, 3, 12])
def test_fused_loss_and_gradients_equal_autodiff_of_the_plain_loss(chunks):
    """Any number of pieces: the same summed loss, and the same gradients per leaf relative
    to the leaf's largest entry, padding columns (vocab 37 of 40) never predicted; the
    cotangent (here 2.5) scales both gradients."""
    hidden, embed, labels = _inputs()
    fused = lambda h, e: loss.head_loss_sum(h, e, labels, VOCAB, chunks)  # noqa: E731
    plain = lambda h, e: _plain_loss(h, e, labels)  # noqa: E731
    np.testing.assert_allclose(fused(hidden, embed), plain(hidden, embed), rtol=1e-6)
    want = jax.grad(lambda h, e: 2.5 * plain(h, e), (0, 1))(hidden, embed)
    got = jax.grad(lambda h, e: 2.5 * fused(h, e), (0, 1))(hidden, embed)
    support.assert_within_leaf_scale(got, want, 1e-5, what='gradient')
    assert not np.any(got[1][VOCAB:]), 'padding rows of the embedding got a gradient'


def test_fused_loss_in_bf16_stays_near_the_fp32_gradients():
    """bf16 hidden states and embedding (the GPU configs): fp32 logits and sums, so the
    gradients stay within bf16 rounding of fp32's."""
    hidden, embed, labels = _inputs()
    want = jax.grad(lambda h, e: _plain_loss(h, e, labels), (0, 1))(hidden, embed)
    as_bf16 = (hidden.astype(jnp.bfloat16), embed.astype(jnp.bfloat16))
    got = jax.grad(lambda h, e: loss.head_loss_sum(h, e, labels, VOCAB, 4), (0, 1))(*as_bf16)
    assert got[0].dtype == got[1].dtype == jnp.bfloat16
    got = [g.astype(jnp.float32) for g in got]
    support.assert_within_leaf_scale(got, want, 2e-2, what='gradient')


def test_model_loss_does_not_depend_on_loss_chunks():
    """GPT.token_loss_sum through the model: loss_chunks 1 and 4 give the same loss and
    parameter gradients (per leaf, relative)."""
    tokens = jnp.asarray(support.random_batches(1)[0])
    results = []
    for chunks in (1, 4):
        config = support.small_config(loss_chunks=chunks)
        model = gpt.create(config.model, 0)
        graphdef, params, _ = gpt.split(model)
        loss_fn = lambda p: gpt.loss_sum(gpt.merge(graphdef, p), tokens)[0]  # noqa: E731
        results.append(jax.value_and_grad(loss_fn)(params))
    (loss_1, grads_1), (loss_4, grads_4) = results
    np.testing.assert_allclose(loss_4, loss_1, rtol=1e-6)
    support.assert_within_leaf_scale(grads_4, grads_1, 1e-5, what='gradient')
