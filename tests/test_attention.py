"""Fused attention against the plain einsums: jax.nn.dot_product_attention (cuDNN's flash
attention on GPUs) and the Pallas flash kernel (model/flash_attention.py, interpreted on this
CPU) give the same loss and gradients per leaf, the same decoding; the flash kernel's dropout
is its reference's and does not depend on the layout; which kernel a config gets where; and
what is refused."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import attention_kernel as kernels
from mtnlg_jax.model import flash_attention, gpt
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
        (dict(compute_dtype='bfloat16', attention_dropout=0.1), A100, 'flash'),
        (dict(compute_dtype='bfloat16', hidden=8 * 160), A100, 'flash'),  # MT-NLG's head dim
        (dict(compute_dtype='bfloat16', hidden=8 * 160), H100, 'cudnn'),
        (dict(compute_dtype='bfloat16', hidden=8 * 160, attention_dropout=0.1), H100, 'flash'),
        (dict(compute_dtype='bfloat16', hidden=8 * 512), A100, 'plain'),  # over 256
        (dict(compute_dtype='bfloat16', attention='plain'), H100, 'plain'),
        (dict(compute_dtype='float32', attention='fused'), CPU, 'xla'),
        (
            dict(compute_dtype='float32', attention='fused', attention_dropout=0.1),
            CPU,
            'flash_interpreted',
        ),
        (dict(compute_dtype='float32', attention='flash'), CPU, 'flash_interpreted'),
        (dict(compute_dtype='float32', attention='flash'), A100, 'flash'),
    ],
)
def test_which_kernel_a_config_gets(overrides, device, kernel):
    cfg = _model_cfg(overrides.pop('attention', 'auto'), **overrides)
    assert kernels.attention_kernel(cfg, device) == kernel


@pytest.mark.parametrize(
    'overrides, device, kernel',
    [
        (dict(), H100, 'flash'),  # cuDNN would take documents only as a (seq x seq) mask
        (dict(), A100, 'flash'),
        (dict(seq_len=40), H100, 'cudnn'),  # no flash tile divides 40: cuDNN and its mask
        (dict(attention_dropout=0.1), H100, 'flash'),
        (dict(), CPU, 'plain'),
        (dict(attention='fused'), CPU, 'xla'),
    ],
)
def test_packed_documents_take_a_kernel_that_reads_their_ids_not_a_mask(overrides, device, kernel):
    """data.reset_attention_mask: where attention_kernel would run cuDNN, which takes
    documents only as a (seq x seq) mask, the Pallas flash kernel runs with the segment ids,
    wherever it takes the shape; the planner prices the same kernel."""
    cfg = _model_cfg(overrides.pop('attention', 'auto'), compute_dtype='bfloat16', **overrides)
    assert kernels.attention_kernel(cfg, device, documents=True) == kernel
    assert kernels.documents_kernel(kernels.attention_kernel(cfg, device), cfg.seq_len, 8,
                                    kernels.gpu_generation(device)) == kernel  # fmt: skip


def test_fused_attention_where_no_kernel_can_is_refused():
    with pytest.raises(config_lib.ConfigError, match='cuDNN cannot fuse float32 compute'):
        kernels.attention_kernel(_model_cfg('fused'), A100)
    with pytest.raises(config_lib.ConfigError, match='cannot take head dim 512'):
        big_heads = _model_cfg('fused', compute_dtype='bfloat16', hidden=8 * 512)
        kernels.attention_kernel(big_heads, A100)
    with pytest.raises(config_lib.ConfigError, match='cannot take sequence length 40'):
        kernels.attention_kernel(_model_cfg('flash', seq_len=40), CPU)


def _flash_against_reference(
    shape, kv_heads, dtype, relative, rate=0.0, segments=False, q_offset=None, queries=None
):
    """The Pallas kernels (interpreted) against materialised scores with repeated key/value
    heads, the same dropout bits and the same segment mask: the output and the gradient of
    every input, per leaf relative to its scale. q_offset: `queries` queries at that offset
    among the seq keys (a context-parallel chunk)."""
    batch, seq, heads, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 6)
    q_shape = shape if q_offset is None else (batch, queries, heads, head_dim)
    q, weight = (jax.random.normal(key, q_shape).astype(dtype) for key in keys[:2])
    k, v = (
        jax.random.normal(key, (batch, seq, kv_heads, head_dim)).astype(dtype) for key in keys[2:4]
    )
    seeds = flash_attention.head_seeds(jax.random.split(keys[4], batch), 3, heads)
    segment_ids = None
    if segments:  # documents of random lengths, some shorter than a block, some longer
        segment_ids = jnp.cumsum(jax.random.bernoulli(keys[5], 0.04, (batch, seq)), axis=1)

    def flash(q, k, v):
        return flash_attention.flash_attention(
            q, k, v, seeds, rate, segment_ids=segment_ids, q_offset=q_offset, interpret=True
        )

    def reference(q, k, v):
        return flash_attention.reference(q, k, v, seeds, rate, segment_ids, q_offset or 0)

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * weight).sum()

    out, want = jax.jit(flash)(q, k, v), jax.jit(reference)(q, k, v)
    support.assert_within_leaf_scale(
        [out.astype(jnp.float32)], [want.astype(jnp.float32)], relative, what='output'
    )
    grads = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    wanted = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(q, k, v)
    support.assert_within_leaf_scale(
        [g.astype(jnp.float32) for g in grads], [g.astype(jnp.float32) for g in wanted],
        relative, what='gradient',
    )  # fmt: skip


def test_flash_kernel_with_dropout_and_grouped_heads_gives_its_reference():
    """MT-NLG's head dim 160 (lanes 128 + 32), two query heads per key/value head, dropout 0.1:
    two forward query blocks and four backward blocks at seq 128 (A100 blocks), so unmasked
    blocks below the diagonal, diagonal blocks and the online softmax across key blocks run."""
    _flash_against_reference((1, 128, 4, 160), 2, jnp.float32, 1e-5, rate=0.1)


def test_flash_kernel_with_packed_documents_gives_its_reference():
    """Segment ids (documents that do not see each other) in bf16, multi-query attention (one
    key/value head), head dim 20 (one 32-lane piece, 12 lanes masked)."""
    _flash_against_reference((1, 128, 2, 20), 1, jnp.bfloat16, 2e-2, segments=True)


@pytest.mark.parametrize('q_offset', [0, 32, 96])
def test_flash_kernel_with_a_query_chunks_offset_gives_its_reference(q_offset):
    """Context parallelism's call: 32 queries at an offset among 128 keys (the first chunk,
    one inside, the last), packed documents, two query heads per key/value head, dropout:
    only the key blocks up to the chunk's diagonal are walked, the diagonal one masked."""
    _flash_against_reference(
        (1, 128, 4, 32), 2, jnp.float32, 1e-5, 0.1, True, q_offset=q_offset, queries=32
    )


def test_flash_kernel_packed_document_equals_the_document_alone():
    """A document packed after another gets the context it gets alone at position 0 (its
    keys, not the first document's): the kernel with segment ids against the kernel on the
    document by itself."""
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(key, (1, 64, 2, 16)) for key in keys)
    segment_ids = (jnp.arange(64) >= 16).astype(jnp.int32)[None] + (jnp.arange(64) >= 48)
    packed = flash_attention.flash_attention(q, k, v, segment_ids=segment_ids, interpret=True)
    alone = flash_attention.flash_attention(*(a[:, 16:48] for a in (q, k, v)), interpret=True)
    np.testing.assert_allclose(packed[:, 16:48], alone, atol=1e-5)


@pytest.mark.parametrize(
    'head_dim, pieces',
    [
        (160, ((0, 128), (128, 32))),
        (128, ((0, 128),)),
        (8, ((0, 16),)),
        (96, ((0, 64), (64, 32))),
        (200, ((0, 128), (128, 128))),
    ],
)
def test_flash_lanes_of_head_dim_160_are_128_plus_32_not_256(head_dim, pieces):
    assert flash_attention.lane_pieces(head_dim) == pieces


@pytest.mark.parametrize('seq, head_dim', [(96, 64), (96, 160), (48, 128), (2048, 160)])
def test_flash_blocks_are_powers_of_two_dividing_the_sequence(seq, head_dim):
    """Triton tiles are powers of two: seq 96 takes 32-row blocks, not 96; a sequence that is
    no multiple of 16 is refused."""
    for generation in (8, 9):
        chosen = flash_attention.blocks(seq, head_dim, generation)
        for size in chosen[:3]:
            assert size & (size - 1) == 0 and seq % size == 0 and size >= 16
        assert flash_attention.refusal(seq, head_dim, generation) is None
    assert 'sequence length 40' in flash_attention.refusal(40, 64)


def test_flash_dropout_keeps_the_rate_and_differs_by_sequence_head_and_site():
    """Four decisions per hash (a byte each), the rate rounded to 1/256: 0.1 -> 26/256."""
    seq, rate = 128, 0.1
    pos = jnp.arange(seq)
    seeds = flash_attention.head_seeds(jax.random.split(jax.random.key(1), 2), 0, 4)
    other_site = flash_attention.head_seeds(jax.random.split(jax.random.key(1), 2), 1, 4)
    keep = jax.vmap(jax.vmap(lambda s: flash_attention.keep_mask(s, pos, 0, seq, rate)))
    masks, masks_other_site = keep(seeds), keep(other_site)
    kept = 1 - 26 / 256
    assert flash_attention.keep_scale(rate) == pytest.approx(1 / kept)
    assert abs(float(masks.mean()) - kept) < 0.005  # 131,072 draws: 4 sigma ~ 0.0033
    # neighbouring keys share a hash but not a decision: as often equal as independent ones
    neighbours = float((masks[..., 0::4] == masks[..., 1::4]).mean())
    assert abs(neighbours - (kept**2 + (1 - kept) ** 2)) < 0.01
    # a block of keys gets the same block of the whole row's mask (blocks do not matter)
    part = flash_attention.keep_mask(seeds[0, 0], pos[32:64], 64, 32, rate)
    np.testing.assert_array_equal(part, masks[0, 0, 32:64, 64:96])
    flat = masks.reshape(8, -1)
    agreement = (flat[:, None] == flat[None]).mean(-1)
    off_diagonal = agreement[~np.eye(8, dtype=bool)]
    assert float(off_diagonal.max()) < 1 - 2 * rate * (1 - rate) + 0.01  # independent masks
    assert float((masks != masks_other_site).mean()) > 0.15


def test_the_flash_path_gives_the_plain_loss_and_gradients():
    """model.attention=flash through the whole GPT (fp32, no dropout): the plain path's loss
    and every gradient per leaf."""
    flash_loss, flash = _loss_and_grads(_model_cfg('flash'))
    plain_loss, plain = _loss_and_grads(_model_cfg('plain'))
    np.testing.assert_allclose(flash_loss, plain_loss, rtol=1e-5)
    support.assert_within_leaf_scale(flash, plain, 1e-5, what='gradient')


def test_the_flash_path_with_grouped_heads_gives_the_plain_loss_and_gradients():
    """Grouped-query attention (8 query heads over 2 key/value heads) through the whole GPT:
    the kernel reads each group's key/value head, never a repeated copy."""
    flash_loss, flash = _loss_and_grads(_model_cfg('flash', kv_heads=2))
    plain_loss, plain = _loss_and_grads(_model_cfg('plain', kv_heads=2))
    np.testing.assert_allclose(flash_loss, plain_loss, rtol=1e-5)
    support.assert_within_leaf_scale(flash, plain, 1e-5, what='gradient')


def test_flash_dropout_does_not_depend_on_the_layout():
    """The flash kernel's masks come from (sequence key, site, global head): data 2 x tensor 4
    with two micro-steps computes one device's loss and gradients, and dropout changes them."""
    support.assert_dropout_does_not_depend_on_the_layout(
        dict(data=2, tensor=4, micro_steps=2), dict(attention_dropout=0.2), attention='flash'
    )
