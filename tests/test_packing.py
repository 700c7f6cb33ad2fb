"""Packed documents that do not see each other (data/packing.py): the positions, segment ids
and loss mask are Megatron's get_ltor_masks_and_position_ids; a document packed after another
gets the loss and gradients it gets alone at position 0, on every attention kernel; the masked
loss is the token-weighted mean; the train step's layouts, pipelined ones (1F1B, interleaved,
GPipe) included, agree with packing on, and the pipelined eval loss counts only the tokens the
loss mask keeps; bad keys are one error naming the key."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
import test_pipeline  # its layouts, depth and eval step
from mtnlg_jax import config as config_lib
from mtnlg_jax.data import packing
from mtnlg_jax.data.tokenizer import Tokenizer
from mtnlg_jax.model import gpt
from mtnlg_jax.model.loss import cross_entropy

EOD = 7
# Llama's block (rope: the positions in every chunk) in 1F1B d2 s2 t2 (full recompute) and in
# interleaved d2 s2 t2 with 2 repeats (sequence parallel, selective recompute), both on two
# sequence pieces: test_llama_block.py's pipelined 1F1B and interleaved cases, carried here (one
# compile for both files' assertions); GPipe d2 s2 t2 with 2 repeats with GPT's block (learned
# positions: the first chunk's embedding).
LLAMA_1F1B = dict(support.LLAMA_BLOCK, remat='full', sequence_pieces=2)
LLAMA_INTERLEAVED = dict(
    support.LLAMA_BLOCK, sequence_parallel=True, remat='selective', sequence_pieces=2
)
PIPELINED = [
    (*test_pipeline.D2S2T2_1F1B[:-1], LLAMA_1F1B),
    (*test_pipeline.D2S2T2_INTERLEAVED[:-1], LLAMA_INTERLEAVED),
    test_pipeline.D2S2T2_GPIPE,
]


def _is_llama(layout):
    return layout[-1].get('mlp') == 'swiglu'


def _pipelined_name(layout):
    return test_pipeline._name(layout) + ('-llama' if _is_llama(layout) else '')


def megatron_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's get_ltor_masks_and_position_ids, its loops as written there (numpy for
    torch): (attention mask, True = may attend; loss mask; position ids)."""
    batch, seq = data.shape
    attention = np.tril(np.ones((batch, seq, seq)))
    loss_mask = np.ones(data.shape, np.float32)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = np.tile(np.arange(seq), (batch, 1))
    for b in range(batch):
        eod_index = np.nonzero(data[b] == eod)[0]
        prev_index = 0
        for i in eod_index:
            if reset_attention_mask:
                attention[b, i + 1 :, : i + 1] = 0
            if reset_position_ids:
                position_ids[b, i + 1 :] -= i + 1 - prev_index
                prev_index = i + 1
    return attention > 0.5, loss_mask, position_ids


@pytest.mark.parametrize('flags', list(itertools.product((False, True), repeat=3)))
def test_positions_segments_and_loss_mask_are_megatrons(flags):
    """Rows with EODs first, last, adjacent and none: the same positions, loss mask and
    (from segment ids and causality) attention mask as Megatron's loops, for every setting."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 12, (6, 24))
    data[0, 0] = data[0, -1] = data[1, 5] = data[1, 6] = EOD
    data[2] = np.where(data[2] == EOD, 8, data[2])  # one document, no EOD
    attention, loss_mask, positions = megatron_masks(data, EOD, *flags)
    packed = packing.packed_inputs(jnp.asarray(data), EOD, *flags)
    seq = data.shape[1]
    ours_positions = np.arange(seq) if packed.positions is None else packed.positions
    ours_loss = np.ones(data.shape) if packed.loss_mask is None else packed.loss_mask
    ours_attention = np.tril(np.ones((seq, seq), bool))[None]
    if packed.segment_ids is not None:
        segments = np.asarray(packed.segment_ids)
        ours_attention = ours_attention & (segments[:, :, None] == segments[:, None, :])
    np.testing.assert_array_equal(np.broadcast_to(ours_positions, data.shape), positions)
    np.testing.assert_array_equal(ours_loss, loss_mask)
    np.testing.assert_array_equal(np.broadcast_to(ours_attention, attention.shape), attention)


def _document(rng, length):
    """`length` tokens ending in the EOD, none before it."""
    tokens = rng.integers(8, support.VOCAB, length)
    tokens[-1] = EOD
    return tokens


def _loss_and_grads_of(graphdef, params, row, document, flags=(True, True, True)):
    """Loss sum and gradients of the tokens of segment `document` of one row (seq + 1)."""
    tokens = jnp.asarray(row[None], jnp.int32)
    packed = packing.packed_inputs(tokens[:, :-1], EOD, *flags)
    segments = packing.packed_inputs(tokens[:, :-1], EOD, False, True, False).segment_ids
    mask = (segments == document).astype(jnp.float32)
    if packed.loss_mask is not None:
        mask = mask * packed.loss_mask
    packed = packed._replace(loss_mask=mask)

    def loss(p):
        return gpt.loss_sum(gpt.merge(graphdef, p), tokens, packed=packed)[0]

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize('attention', ['plain', 'fused', 'flash'])
def test_a_document_packed_after_another_gets_its_loss_and_gradients_alone(attention):
    """Document B after A in one row, and B alone at position 0 (another document after it):
    B's summed loss and every parameter's gradient from it agree, per leaf relative to its
    scale (fp32). 'fused' is the call cuDNN serves on a GPU (XLA's implementation here). Without
    reset_attention_mask B sees A, and its gradients move far beyond the tolerance."""
    cfg = support.small_config(attention=attention).model
    graphdef, params, _ = gpt.split(gpt.create(cfg, 0))
    rng = np.random.default_rng(1)
    a, b = _document(rng, 11), _document(rng, 13)
    filler = rng.integers(8, support.VOCAB, support.SEQ_LEN + 1)
    packed_row = np.concatenate([a, b, filler])[: support.SEQ_LEN + 1]
    alone_row = np.concatenate([b, filler])[: support.SEQ_LEN + 1]
    packed_loss, packed_grads = _loss_and_grads_of(graphdef, params, packed_row, document=1)
    alone_loss, alone_grads = _loss_and_grads_of(graphdef, params, alone_row, document=0)
    np.testing.assert_allclose(packed_loss, alone_loss, rtol=1e-6)
    support.assert_within_leaf_scale(packed_grads, alone_grads, 1e-5, what='gradient')
    _, seeing = _loss_and_grads_of(graphdef, params, packed_row, 1, flags=(True, False, True))
    with pytest.raises(AssertionError):
        support.assert_within_leaf_scale(seeing, alone_grads, 1e-2, what='gradient')


def test_the_masked_loss_is_the_token_weighted_mean_and_its_gradient_autodiffs():
    """gpt.loss_sum with a loss mask: the sum of the unmasked tokens' cross-entropy, counted
    by the mask (Megatron's sum(loss x mask) / sum(mask)); the fused head's gradients equal
    autodiff's through the whole logits, per leaf."""
    cfg = support.small_config(attention='plain', loss_chunks=2).model
    graphdef, params, _ = gpt.split(gpt.create(cfg, 0))
    tokens = jnp.asarray(support.random_batches(1)[0][:4], jnp.int32)
    tokens = tokens.at[:, 5].set(EOD).at[:, 17].set(EOD)
    packed = packing.packed_inputs(tokens[:, :-1], EOD, False, False, True)
    assert float(packed.loss_mask.sum()) == tokens[:, :-1].size - 8

    def fused(p):
        total, count = gpt.loss_sum(gpt.merge(graphdef, p), tokens, packed=packed)
        return total / count

    def reference(p):
        model = gpt.merge(graphdef, p)
        losses = cross_entropy(model.logits(model(tokens[:, :-1])), tokens[:, 1:])
        return (losses * packed.loss_mask).sum() / packed.loss_mask.sum()

    got_loss, got = jax.jit(jax.value_and_grad(fused))(params)
    want_loss, want = jax.jit(jax.value_and_grad(reference))(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    support.assert_within_leaf_scale(got, want, 1e-5, what='gradient')


PACKING = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def _packed(config, eod_id=EOD):
    """A resolved config with the three keys on."""
    mesh = config.mesh
    config = config_lib.inputs_of(config)
    config.data.update(PACKING, eod_id=eod_id)
    return config_lib.resolve(config, mesh.data * mesh.stage * mesh.tensor)


def _packed_config(eod_id=EOD, **layout):
    return _packed(support.small_config(**layout), eod_id)


def _packed_batch():
    """A global batch whose rows hold several documents: an EOD every 9 tokens."""
    batch = support.random_batches(1)[0]
    batch[:, 3::9] = EOD
    return batch


def test_a_packed_layout_equals_one_device():
    """The train step with all three keys on, rows of several documents: data 2 x tensor 2
    (sequence parallel) gives one device's loss and gradients."""
    batch = _packed_batch()
    _, loss_one, grads_one = support.gradients(_packed_config(micro_steps=1), batch)
    layout = dict(data=2, tensor=2, micro_steps=2)
    config = config_lib.inputs_of(_packed_config(**layout))
    config.model.sequence_parallel = True
    _, loss_many, grads_many = support.gradients(config_lib.resolve(config, 4), batch)
    np.testing.assert_allclose(loss_many, loss_one, rtol=1e-6)
    support.assert_gradients_close(grads_many, grads_one)


@functools.cache
def packed_one_device(llama=False):
    """(initial parameters, loss, gradients) of the packed batch on one device, the three keys
    on, at test_pipeline's depth, GPT's block or Llama's (no recompute, no pieces)."""
    model = support.LLAMA_BLOCK if llama else {}
    config = _packed_config(num_layers=test_pipeline.LAYERS, **model)
    return support.gradients(config, _packed_batch())


@pytest.mark.parametrize('layout', PIPELINED, ids=_pipelined_name)
def test_a_packed_pipelined_layout_equals_one_device(layout):
    """The three keys on, rows of several documents: each engine hands every chunk its
    micro-batch's positions (learned: the first chunk's embedding; rope: every chunk's
    blocks), segment ids and loss mask, and gives one device's initial parameters (bit for
    bit), loss and gradients (per leaf, relative to its scale), Llama's under recompute,
    sequence parallelism and sequence pieces as without them."""
    params, loss, grads = packed_one_device(llama=_is_llama(layout))
    config = _packed(test_pipeline._config(layout))
    params_piped, loss_piped, grads_piped = support.gradients(config, _packed_batch())
    support.assert_trees_close(params_piped, params, atol=0.0)
    np.testing.assert_allclose(loss_piped, loss, rtol=1e-6)
    support.assert_gradients_close(grads_piped, grads)


def test_the_keys_change_the_packed_batchs_loss():
    """What the pipelined layouts are held to depends on the keys: the model's loss of the
    packed batch is the step's with them on, and moves 100 x the layouts' tolerance without
    them (so a pipeline that ignored them would fail)."""
    _, loss, _ = packed_one_device()
    config = _packed_config(num_layers=test_pipeline.LAYERS)
    graphdef, params, _ = gpt.split(gpt.create(config.model, config.train.seed))
    tokens = jnp.asarray(_packed_batch(), jnp.int32)
    loss_of = jax.jit(
        lambda packed: gpt.loss_sum(gpt.merge(graphdef, params), tokens, packed=packed)
    )
    total, count = loss_of(packing.of_config(config)(tokens[:, :-1]))
    np.testing.assert_allclose(total / count, loss, rtol=1e-6)
    total, count = loss_of(None)
    assert abs(total / count - loss) > 1e-4 * loss


def test_the_pipelined_eval_loss_counts_only_the_loss_masks_tokens():
    """The eval step on 1F1B d2 s2 t2, the three keys on: the one-device loss, its sum and
    count over the tokens the loss mask keeps (every input but the EODs)."""
    _, loss, _ = packed_one_device()
    batch = _packed_batch()
    config = _packed(test_pipeline._config(test_pipeline.D2S2T2_1F1B))
    loss_sum, count = test_pipeline.eval_sums(config, batch)
    assert count == batch[:, :-1].size - (batch[:, :-1] == EOD).sum()
    np.testing.assert_allclose(loss_sum / count, loss, rtol=1e-6)


@pytest.mark.parametrize(
    'key, value, words',
    [
        ('data.eod_id', 5000, 'below model.vocab_size'),
        ('data.eod_id', -2, 'must be -1 or'),
    ],
)
def test_bad_packing_keys_are_one_error_naming_the_key(key, value, words):
    config = config_lib.inputs_of(support.small_config())
    config.data.update(PACKING)
    section, name = key.split('.')
    config[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=words) as error:
        config_lib.resolve(config, config.mesh.stage)
    assert error.value.key.startswith('data.')


def test_the_eod_id_comes_from_the_tokenizer_or_is_asked_for(tmp_path):
    """data.eod_id -1 takes the tokenizer's end-of-document id; with no tokenizer, an error
    naming data.eod_id."""
    config = _packed_config(eod_id=-1)
    config.data.tokenizer = ''
    with pytest.raises(config_lib.ConfigError, match='data.eod_id'):
        packing.resolve_eod_id(config)
    tokenizer = Tokenizer.train(['In the beginning was the word.'] * 20, str(tmp_path / 't'), 300)
    config.data.tokenizer = tokenizer.model_path
    assert packing.resolve_eod_id(config).data.eod_id == tokenizer.eod_id == 1
