"""Context parallelism (parallel/context.py): each sequence in 2 x context chunks, rank r
holding chunks r and 2c - 1 - r, keys and values gathered over 'context'. On packed documents
every context layout computes one device's loss and gradients (GPT's block and Llama's; with
full recompute and the block on sequence pieces; pipelined interleaved, and plain 1F1B on
stages of unequal depth); no attention leaks across a document that starts in a chunk and
ends in its mirror; the compiled step gathers keys and values over 'context' in every layer;
bad sizes are one error naming the key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
import test_pipeline  # its eval step
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import layers
from mtnlg_jax.model.attention import Attention
from mtnlg_jax.parallel import context as context_lib
from mtnlg_jax.parallel.mesh import make_mesh
from mtnlg_jax.parallel.rules import constrain
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import arithmetic, comm, hlo

EOD = 7
PACKING = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
LAYOUTS = {  # (data, context, tensor, sequence_parallel, more keys of small_config)
    # full recompute, the block's attention and MLP on 2 pieces of each sequence
    'd2c2t2sp-full-pieces2': (2, 2, 2, True, dict(remat='full', sequence_pieces=2)),
    'c4t2': (1, 4, 2, False, {}),
    'c8': (1, 8, 1, False, {}),
}
# GPT in 4 layers: the pipelined layout's (a layer a chunk), so one device's reference serves it
BLOCKS = {'gpt': dict(num_layers=4), 'llama': support.LLAMA_BLOCK}


def context_config(
    data=1, context=1, tensor=1, sequence_parallel=False, micro_steps=2, stage=1, **more
):
    """small_config on data x stage x context x tensor with packed documents (the three keys
    on); more: small_config's keys (repeats, schedule) and model keys."""
    config = config_lib.inputs_of(
        support.small_config(data, stage, tensor, micro_steps=micro_steps, **more)
    )
    config.mesh.context = context
    config.model.sequence_parallel = sequence_parallel
    config.data.update(PACKING, eod_id=EOD)
    return config_lib.resolve(config, data * stage * context * tensor)


def packed_batch(seq=support.SEQ_LEN):
    """A global batch of several documents a row (an EOD every 9 tokens: documents cross the
    chunks' edges at every context size), rows of seq + 1 tokens."""
    batch = np.concatenate([support.random_batches(1, seed=s)[0] for s in range(seq // 32)], 1)
    batch = np.concatenate([batch, batch[:, :1]], axis=1)[:, : seq + 1]
    batch[:, 3::9] = EOD
    return batch


@pytest.fixture(scope='module')
def one_device():
    return {
        name: support.gradients(context_config(micro_steps=1, **block), packed_batch())[1:]
        for name, block in BLOCKS.items()
    }


def test_rank_r_holds_chunk_r_and_its_mirror():
    """seq 16, context 2: rank 0 chunks 0 and 3, rank 1 chunks 1 and 2; context 1: as is."""
    order = context_lib.chunk_order(16, 2)
    np.testing.assert_array_equal(order[:8], [0, 1, 2, 3, 12, 13, 14, 15])
    np.testing.assert_array_equal(order[8:], [4, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(context_lib.chunk_order(16, 1), np.arange(16))
    assert sorted(context_lib.chunk_order(32, 8)) == list(range(32))


# every layout once, both blocks between them (a covering set: each case compiles a step)
@pytest.mark.parametrize(
    'layout, block', [('d2c2t2sp-full-pieces2', 'llama'), ('c4t2', 'gpt'), ('c8', 'llama')]
)
def test_a_packed_context_layout_equals_one_device(one_device, layout, block):
    """Loss and every gradient (per leaf, within 1e-5 of its largest) of one device, fp32
    (which recomputes nothing and runs whole sequences)."""
    data, context, tensor, sp, more = LAYOUTS[layout]
    config = context_config(data, context, tensor, sp, **more, **BLOCKS[block])
    _, loss, grads = support.gradients(config, packed_batch())
    loss_one, grads_one = one_device[block]
    np.testing.assert_allclose(loss, loss_one, rtol=1e-6)
    support.assert_gradients_close(grads, grads_one)


PIPELINES = {  # GPT's 4 layers on stage 2 x context 2 x tensor 2, 4 micro-batches
    'gpt-s2c2t2-interleaved': dict(repeats=2, schedule='interleaved'),  # 2 chunks a stage
    'gpt-s2c2t2-1f1b-first1': dict(first_stage_layers=1),  # stages of 1 and 3 layers
}


@pytest.mark.parametrize('pipeline', PIPELINES)
def test_a_pipelined_context_layout_equals_one_device(one_device, pipeline):
    """Interleaved 1F1B, and plain 1F1B on stages of unequal depth: every chunk gets its
    micro-batch's global positions with its tokens."""
    loss_one, grads_one = one_device['gpt']
    pipelined = dict(micro_steps=4, stage=2, **PIPELINES[pipeline], **BLOCKS['gpt'])
    config = context_config(1, 2, 2, **pipelined)
    _, loss, grads = support.gradients(config, packed_batch())
    np.testing.assert_allclose(loss, loss_one, rtol=1e-6)
    support.assert_gradients_close(grads, grads_one)


def test_the_eval_step_on_context_parallel_layouts_counts_one_devices_loss(one_device):
    """The eval step (no gradients) on context 2 x tensor 2 x data 2 with sequence
    parallelism: one device's loss, summed over the tokens the loss mask keeps."""
    batch = packed_batch()
    loss_sum, count = test_pipeline.eval_sums(context_config(2, 2, 2, True, **BLOCKS['gpt']), batch)
    assert count == batch[:, :-1].size - (batch[:, :-1] == EOD).sum()
    np.testing.assert_allclose(loss_sum / count, one_device['gpt'][0], rtol=1e-6)


def test_the_flash_kernel_with_each_chunks_offset_equals_one_device():
    """The Pallas flash kernel (interpreted) on context 2 x tensor 2 x data 2 with sequence
    parallelism, Llama's block (grouped-query heads), seq 64 (chunks of 16, its smallest
    tile), attention dropout on: one device's flash loss and gradients (the dropout bits
    are drawn from global query and key positions, so they are one device's too)."""
    model = dict(support.LLAMA_BLOCK, seq_len=64, attention='flash', attention_dropout=0.1)
    batch = packed_batch(64)
    _, loss_one, grads_one = support.gradients(context_config(micro_steps=1, **model), batch)
    config = context_config(2, 2, 2, True, **model)
    _, loss, grads = support.gradients(config, batch)
    np.testing.assert_allclose(loss, loss_one, rtol=1e-6)
    support.assert_gradients_close(grads, grads_one)


def _leaky_attention():
    """(outputs of attention over q, k, v with the values outside one document scaled by
    1e6, outputs with them as they are, one device's outputs, the document's places), all in
    the chunked order: context
    2, seq 32 (chunks of 8); the document runs from 5 (inside chunk 0) to 27 (inside chunk 3,
    chunk 0's mirror), so rank 0 holds both its ends."""
    config = support.small_config()
    attention = Attention(config.model, nnx.Rngs(params=0))
    seq, heads, head_dim = support.SEQ_LEN, config.model.heads, config.model.hidden // 8
    segment_ids = np.zeros((1, seq), np.int32)
    segment_ids[:, 5:28], segment_ids[:, 28:] = 1, 2
    order = context_lib.chunk_order(seq, 2)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, seq, heads, head_dim)) for key in keys)
    outside = (segment_ids != 1)[:, :, None, None]
    mesh = make_mesh(context=2)

    @jax.jit
    def attend(q, k, v):
        q, k, v = (constrain(a[:, order], ('batch', 'seq', 'heads', 'head_dim')) for a in (q, k, v))
        positions = jnp.asarray(order)[None]
        return attention.context(q, k, v, None, 0, jnp.asarray(segment_ids[:, order]), positions)

    with jax.set_mesh(mesh):
        leaked = attend(q, k, jnp.where(outside, 1e6 * v, v))
        clean = attend(q, k, v)
    one_device = attention.context(q, k, v, None, 0, jnp.asarray(segment_ids))[:, order]
    inside = segment_ids[0, order] == 1
    return np.asarray(leaked), np.asarray(clean), np.asarray(one_device), inside


def test_no_attention_leaks_across_a_document_that_ends_in_its_chunks_mirror():
    """A document that starts inside rank 0's first chunk and ends inside its mirror: scaling
    every value outside it by 1e6 leaves its queries' outputs as they were, so their attention
    probabilities on those keys are zero; the outputs are one device's (masks from global
    positions); and the scaled values do reach the other documents' queries."""
    leaked, clean, one_device, inside = _leaky_attention()
    np.testing.assert_allclose(clean, one_device, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(leaked[:, inside], clean[:, inside], rtol=1e-6, atol=1e-6)
    assert np.abs(leaked[:, ~inside] - clean[:, ~inside]).max() > 1.0


def test_context_ranks_draw_their_own_dropout_masks():
    """In a region manual over 'context' (the train step's) each rank holds its own places of
    a sequence: its hidden dropout mask is its own, not one mask drawn on every rank."""
    mesh = make_mesh(context=2)
    row_keys = jax.random.split(jax.random.key(0), 2)
    ones = jnp.ones((2, 16, 8))

    def per_rank(x):
        return layers.dropout(x, 0.5, row_keys, site=3)

    spec = jax.sharding.PartitionSpec(None, 'context')
    with jax.set_mesh(mesh):
        kept = jax.jit(jax.shard_map(per_rank, in_specs=spec, out_specs=spec))(ones)
    kept = np.asarray(kept) > 0
    assert 0.2 < kept.mean() < 0.8
    assert (kept[:, :8] != kept[:, 8:]).any()


@pytest.fixture(scope='module')
def compiled_c4t2():
    """(config, collective inventory) of the compiled train step on context 4 x tensor 2,
    2 micro-steps, full recompute."""
    config = context_config(1, 4, 2, micro_steps=2, remat='full')
    compiled, _, info = compile_lib.compile_train_step(config)
    return config, hlo.collective_inventory(compiled.as_text(), info['mesh'])


def test_the_compiled_step_gathers_keys_and_values_over_context(compiled_c4t2):
    """In the compiled train step, all-gathers over 'context' alone run in the layer loop
    (keys and values, forward and the recomputed forward), and their gradients are summed
    back over 'context' (a reduce-scatter, or XLA:CPU's all-reduce)."""
    config, inventory = compiled_c4t2
    over_context = [e for e in inventory if e['axes'] == ('context',)]
    layers = config.model.num_layers * config.train.micro_steps
    gathers = [e for e in over_context if e['kind'] == 'all-gather' and e['count'] >= layers]
    # K (or K and V together) whole over the sequence: rows x seq x heads / tensor x head dim
    heads = config.model.heads // config.mesh.tensor
    kv = config.train.micro_batch * config.model.seq_len * heads * 8 * 4
    assert gathers and all(e['bytes'] in (kv, 2 * kv) for e in gathers), over_context
    assert [e for e in over_context if e['kind'] in ('reduce-scatter', 'all-reduce')]


def test_the_gradients_are_summed_over_context_once_a_step_by_zero1(compiled_c4t2):
    """No all-reduce over 'context' runs in a loop (each context rank's gradients leave the
    train step's region unsummed: rules.region_axes); ZeRO-1's reduce-scatter over it, after
    the loops, carries every fp32 gradient this device computes, once."""
    config, inventory = compiled_c4t2
    over_context = [e for e in inventory if 'context' in e['axes']]
    assert not [e for e in over_context if e['kind'] == 'all-reduce' and e['in_loop']]
    zero = [e for e in over_context if e['kind'] == 'reduce-scatter' and not e['in_loop']]
    compute, _ = arithmetic.local_param_counts(config)
    assert sum(e['bytes'] * e['count'] for e in zero) == 4 * compute


def test_the_plan_counts_the_key_value_gathers_of_the_compiled_step(compiled_c4t2):
    """plan/comm.py's all-gather bytes over 'context' a step are the compiled step's,
    ring-counted: the keys and values per layer and micro-step (forward and recompute), and
    ZeRO-1's all-gather of the compute copy over data x context (data 1 here: 'context'),
    the step's gathers outside the loops."""
    config, inventory = compiled_c4t2
    layers = config.model.num_layers * config.train.micro_steps
    over_context = [e for e in inventory if e['axes'] == ('context',) and e['kind'] == 'all-gather']
    key_values = [e for e in over_context if e['count'] >= layers]
    zero = [e for e in over_context if not e['in_loop']]
    assert key_values and zero
    compiled = sum(e['wire_bytes'] * e['count'] for e in key_values + zero)
    planned = comm.comm_bytes_per_device(config)
    assert planned['all-gather']['context'] == pytest.approx(compiled)
    # and the reduce-scatters: the keys' and values' gradients, ZeRO-1's once a step
    scatters = [e for e in inventory if e['axes'] == ('context',) and e['kind'] == 'reduce-scatter']
    compiled = sum(e['wire_bytes'] * e['count'] for e in scatters)
    assert planned['reduce-scatter']['context'] == pytest.approx(compiled)
    assert 'context' not in planned.get('all-reduce', {})


@pytest.mark.parametrize(
    'layout,words',
    [
        (dict(context=4, seq_len=36), 'model.seq_len=36 does not cut into 2 x 4 chunks'),
        (dict(context=2, tensor=4, sp=True, seq_len=24), 'split over mesh.tensor=4'),
        (dict(context=2, attention='fused'), "'fused' cannot run with mesh.context=2"),
        (dict(context=2, attention='flash'), 'a multiple of 16 tokens (got 8)'),
        (dict(context=8, sequence_pieces=8), 'the 4 tokens of a sequence shard'),
    ],
)
def test_bad_context_sizes_are_one_error_naming_the_key(layout, words):
    config = config_lib.inputs_of(support.small_config())
    config.mesh.context = layout.pop('context')
    config.mesh.tensor = layout.pop('tensor', 1)
    config.model.sequence_parallel = layout.pop('sp', False)
    config.model.update(layout)
    config.mesh.data = 1
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.resolve(config, config.mesh.context * config.mesh.tensor)
    assert words in str(error.value)
    assert error.value.key in ('mesh.context', 'model.attention', 'model.sequence_pieces')
