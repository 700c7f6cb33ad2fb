"""The Llama block options (rope with llama3 scaling, RMSNorm, SwiGLU, grouped-query attention,
untied output, no biases): layouts equal one device, the fused path equals the plain one,
KV-cache decoding equals full recomputation, rope is Meta's, and bad combinations are refused
naming the key."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import counts, gpt, rope
from mtnlg_jax.model.block import Block
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.model.decode import forward_cached, init_cache
from mtnlg_jax.train import optimizer, resume
from mtnlg_jax.train import state as state_lib


def _meta_llama3_scaling(freqs, factor, low, high, context):
    """Meta's llama-models `apply_scaling` (Llama 3.1), transcribed as the reference."""
    low_wavelen, high_wavelen = context / low, context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama3_rope_scaling_is_metas():
    scaling = dict(
        type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192
    )
    plain = rope.inverse_frequencies(128, 500000.0)
    np.testing.assert_allclose(plain, 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128))
    scaled = rope.inverse_frequencies(128, 500000.0, scaling)
    np.testing.assert_allclose(scaled, _meta_llama3_scaling(plain, 8.0, 1.0, 4.0, 8192))
    assert (scaled == plain).any() and (scaled == plain / 8).any()  # both ends, and between:
    assert ((scaled < plain) & (scaled > plain / 8)).any()


def test_rope_rotates_each_channel_pair_by_its_angle():
    """Channel i pairs with i + D/2 (Hugging Face's rotate_half): as complex numbers, the pair
    is multiplied by exp(i position inv_freq)."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
    positions = jnp.array([[0, 1, 2, 7, 100], [3, 3, 9, 0, 1]])
    inv_freq = rope.inverse_frequencies(8, 10000.0)
    out = np.asarray(rope.rotate(x, positions, inv_freq))
    z = np.asarray(x[..., :4]) + 1j * np.asarray(x[..., 4:])
    turned = z * np.exp(1j * np.asarray(positions)[:, :, None, None] * inv_freq)
    np.testing.assert_allclose(out, np.concatenate([turned.real, turned.imag], -1), atol=2e-5)


def test_rope_scores_depend_on_relative_positions_only():
    """Shifting every position by the same amount leaves the model's output unchanged."""
    cfg = support.small_config(**support.LLAMA_BLOCK).model
    model = gpt.create(cfg, 0)
    tokens = jnp.asarray(support.random_batches(1)[0][:2, :16], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    base, shifted = (np.asarray(model(tokens, positions=p)) for p in (positions, positions + 9))
    np.testing.assert_allclose(shifted, base, atol=2e-4)
    assert np.abs(np.asarray(model(tokens[:, ::-1], positions=positions)) - base).max() > 1e-2


def test_parameters_are_named_as_documented():
    cfg = support.small_config(**support.LLAMA_BLOCK).model
    _, params, axes = gpt.split(gpt.create(cfg, 0))
    shapes = {
        '/'.join(str(k.key) for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert shapes == {
        'token_embed': (1024, 64),
        'output_embed': (1024, 64),
        'final_norm/scale': (64,),
        'blocks/ln_attn/scale': (2, 64),
        'blocks/ln_mlp/scale': (2, 64),
        'blocks/attention/q_kernel': (2, 64, 8, 8),
        'blocks/attention/kv_kernel': (2, 64, 2, 4, 8),
        'blocks/attention/out_kernel': (2, 8, 8, 64),
        'blocks/mlp/gate_kernel': (2, 64, 256),  # 8/3 x 64 = 170 up to a multiple of 256
        'blocks/mlp/in_kernel': (2, 64, 256),
        'blocks/mlp/out_kernel': (2, 256, 64),
    }
    assert axes['blocks']['attention']['kv_kernel'] == (
        'layers',
        'embed',
        'qkv',
        'kv_heads',
        'head_dim',
    )


@pytest.mark.parametrize(
    'overrides',
    [
        {},
        support.LLAMA_BLOCK,
        dict(norm='rmsnorm', bias=False),
        dict(mlp='swiglu', kv_heads=2, head_dim=16, tie_embeddings=False),
        dict(position='rope', kv_heads=1, ffn_hidden=100),
    ],
)
def test_the_planners_parameter_count_is_the_models(overrides):
    cfg = support.small_config(**overrides).model
    abstract = nnx.eval_shape(lambda: gpt.create(cfg, 0))
    assert counts.param_count(cfg) == counts.count_params(gpt.split(abstract)[1])


def _loss_and_grads(cfg):
    graphdef, params, _ = gpt.split(gpt.create(cfg, 0))
    tokens = jnp.asarray(support.random_batches(1)[0][:4], jnp.int32)

    def loss(p):
        total, count = gpt.loss_sum(gpt.merge(graphdef, p), tokens)
        return total / count

    return jax.jit(jax.value_and_grad(loss))(params)


def test_fused_grouped_attention_gives_the_plain_loss_and_gradients():
    """jax.nn.dot_product_attention (cuDNN's call on GPUs) takes the kv_heads keys and values
    as they are; the plain path groups the query heads: the same loss and gradients."""
    fused_loss, fused = _loss_and_grads(
        support.small_config(attention='fused', **support.LLAMA_BLOCK).model
    )
    plain_loss, plain = _loss_and_grads(
        support.small_config(attention='plain', **support.LLAMA_BLOCK).model
    )
    np.testing.assert_allclose(fused_loss, plain_loss, rtol=1e-5)
    support.assert_within_leaf_scale(fused, plain, 1e-5, what='gradient')


def _joins(jaxpr):
    """The `stack`s (pieces.join) in a jaxpr and in the jaxprs inside it."""
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive.name == 'stack'
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, 'jaxpr', inner)
                found += _joins(inner) if hasattr(inner, 'eqns') else 0
    return found


@pytest.mark.parametrize('dropout, joins', [(0.0, 4), (0.1, 6)])
def test_the_residual_stream_is_added_piece_by_piece(dropout, joins):
    """On two sequence pieces a Llama block joins its pieces for the attention core's q, k
    and v and once at its end: each sublayer's output is added to its own piece
    (Block.added), so a piece's next norm and all-gather wait on that piece's reduce-scatter
    alone (joined, XLA:GPU fused both pieces' norms into one kernel over the joined stream:
    docs/gpu.md, "Sequence pieces"). Under hidden dropout each sublayer's outputs are joined
    for the mask, drawn on the whole sequence as without pieces: two joins more. (Joined, the
    block took 5 either way.)"""
    cfg = support.small_config(sequence_pieces=2, hidden_dropout=dropout, **support.LLAMA_BLOCK)
    block = Block(cfg.model, nnx.Rngs(0))
    x = jnp.zeros((2, cfg.model.seq_len, cfg.model.hidden), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2)
    traced = jax.make_jaxpr(lambda x: block.layers_on(x, lambda h: h, keys, 0, 0, None, None, None))
    assert _joins(traced(x).jaxpr) == joins


@pytest.mark.parametrize('attention', ['plain', 'fused'])
def test_kv_cache_decoding_equals_full_recomputation_with_gqa_and_rope_scaling(attention):
    """A prompt, then one token at a time through the cache (kv_heads wide, keys rotated at
    their positions), against the whole sequence recomputed: the same logits at every step."""
    cfg = support.small_config(attention=attention, init_std=0.3, **support.LLAMA_BLOCK).model
    assert_cached_decoding_equals_full(cfg)


def assert_cached_decoding_equals_full(cfg, length=20):
    """A prompt of 8 tokens, then single tokens up to `length` through the cache give the
    logits of the whole sequence recomputed."""
    model = gpt.create(cfg, 0)
    cache = init_cache(cfg, 2, cfg.seq_len, jnp.float32)
    assert cache[0].shape == (cfg.num_layers, 2, cfg.seq_len, 4, 8)  # batch, len, kv_heads, dim
    tokens = jnp.asarray(support.random_batches(1)[0][:2, :length], jnp.int32)
    out, cache = forward_cached(model, tokens[:, :8], cache, 0)
    cached = [out]
    for index in range(8, length):
        out, cache = forward_cached(model, tokens[:, index : index + 1], cache, index)
        cached.append(out)
    full = np.asarray(model.logits(model(tokens)))[:, 7:length]
    np.testing.assert_allclose(
        np.stack(cached, 1)[..., : cfg.vocab_size], full[..., : cfg.vocab_size], atol=1e-4
    )


def test_a_llama_block_under_data_tensor_and_sequence_parallelism_equals_one_device():
    """data 2 x tensor 2 with sequence parallelism: each tensor rank holds 4 query heads and
    their 2 key/value heads; the loss and per-leaf gradients of one device (fp32)."""
    batch = support.random_batches(1)[0]
    params, loss, grads = support.gradients(support.small_config(**support.LLAMA_BLOCK), batch)
    config = support.small_config(2, 1, 2, sequence_parallel=True, **support.LLAMA_BLOCK)
    params_tp, loss_tp, grads_tp = support.gradients(config, batch)
    support.assert_trees_close(params_tp, params, atol=0.0)
    np.testing.assert_allclose(loss_tp, loss, rtol=1e-6)
    support.assert_gradients_close(grads_tp, grads)


def test_llama_3_405b_learning_rate_schedule_in_a_jitted_step():
    """Meta's schedule counted in tokens (66.9 B warm-up, 17.3 T decay: beyond int32) as the
    train step evaluates it: 0 -> 8e-5 at the end of the warm-up -> 8e-7 at the end."""
    config = config_lib.load('configs/llama3_405b.py')
    opt = config.optimizer
    schedule = jax.jit(optimizer.learning_rate_schedule(opt))
    lr = [float(schedule(jnp.float32(t))) for t in (0, opt.warmup_tokens, opt.decay_tokens)]
    np.testing.assert_allclose(lr, [0.0, 8e-5, 8e-7], rtol=1e-3)


def test_llama_training_steps_with_zero_1_equal_one_device():
    """Four steps (Adam, the learning-rate schedule) under data 4 x tensor 2, where ZeRO-1
    splits the fp32 state over data, against one device: the same losses, and it learns."""
    batches = support.random_batches(4, seed=1)
    one, _ = support.train_losses(support.small_config(**support.LLAMA_BLOCK), batches)
    zero, _ = support.train_losses(support.small_config(4, 1, 2, **support.LLAMA_BLOCK), batches)
    assert one[-1] < one[0] - 0.05
    np.testing.assert_allclose(zero, one, atol=1e-4)


@pytest.mark.parametrize(
    'overrides, key, message',
    [
        (dict(kv_heads=3), 'model.kv_heads', '3 key/value heads do not divide model.heads=8'),
        (
            dict(kv_heads=2, tensor=4),
            'model.kv_heads',
            '2 key/value heads are not divisible by mesh.tensor=4',
        ),
        (dict(rope_theta=500000.0), 'model.rope_theta', 'model.position is learned'),
        (
            dict(rope_scaling=dict(type='llama3')),
            'model.rope_scaling.type',
            'model.position is learned',
        ),
        (dict(position='rope', head_dim=7), 'model.head_dim', 'head dim 7 must be even'),
        (dict(position='alibi'), 'model.position', "'alibi' is not one of learned, rope"),
        (dict(norm='batchnorm'), 'model.norm', 'is not one of layernorm, rmsnorm'),
        (dict(mlp='relu'), 'model.mlp', 'is not one of gelu, swiglu'),
        (
            dict(sequence_parallel=True, tensor=2, sequence_pieces=3),
            'model.sequence_pieces',
            r'3 pieces do not divide the 64 tokens of a sequence shard \(model.seq_len=128 over',
        ),
        (
            dict(position='rope', rope_scaling=dict(type='llama3', low_freq_factor=5.0)),
            'model.rope_scaling.low_freq_factor',
            'below high_freq_factor=4.0',
        ),
    ],
)
def test_bad_block_combinations_name_the_key(overrides, key, message):
    config = config_lib.load('configs/tiny.py')
    config.mesh.update(dict(data=-1, stage=1, tensor=overrides.pop('tensor', 1)))
    scaling = overrides.pop('rope_scaling', {})
    config.model.update(overrides)
    config.model.rope_scaling.update(scaling)
    with pytest.raises(config_lib.ConfigError, match=f'config key {re.escape(key)}: .*{message}'):
        config_lib.resolve(config, 8)


def test_a_bad_block_is_one_error_line_on_the_command_line(tmp_path):
    result = support.run_launch(
        'plan.py', '--config', 'configs/tiny.py', '--config.model.kv_heads=3'
    )
    assert result.returncode == 2 and result.stdout == ''
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        'error: config key model.kv_heads: 3 key/value heads do not divide model.heads=8'
    ), lines


# Pipelined layouts of Llama's block equal one device in cases that carry other files'
# assertions too (one compile each): 1F1B (full recompute) and interleaved 1F1B (sequence
# parallel, selective recompute), both on two sequence pieces, in test_packing.py's packed
# pipelined cases; ZB-H1 (B and W slots; tensor 2, sequence parallel, full recompute, two
# pieces) over stages of unequal depth in test_unequal_stages.py.


def test_a_llama_checkpoint_restores_under_another_layout(tmp_path):
    """Saved under data 4 x tensor 2, restored into a pipeline (data 2 x stage 2 x tensor 2,
    2 repeats): the same parameters, leaf by leaf, in layer order."""
    from test_checkpoint import restore_into  # noqa: PLC0415

    model = dict(num_layers=4, **support.LLAMA_BLOCK)
    saved_config = support.small_config(4, 1, 2, **model)
    _, setup = support.layout(saved_config)
    state = state_lib.init_state(saved_config, setup)
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    meta = resume.checkpoint_meta(saved_config, resume.fresh_counters())
    checkpoints.save(1, state, meta)
    checkpoints.wait()
    checkpoints.close()
    config = support.small_config(2, 2, 2, 2, 2, **model)
    restored, _, lines = restore_into(tmp_path, config)
    assert 'from step 1' in lines[0]
    expected = jax.device_get(state['params'])
    assert set(expected) == {'token_embed', 'output_embed', 'final_norm', 'blocks'}
    actual = support.in_layer_order(config, restored['params'])
    support.assert_trees_close(actual, expected, atol=0.0)
