"""GPipe order, kept for comparison: autodiff of a forward scan over the circular pipeline.

`pipeline.schedule = 'gpipe'`. p = mesh stage size, v = pipeline.repeats, m = micro-batches per
step, L layers. The stack is cut into p x v chunks of L / (p v) consecutive layers; chunk c
runs on stage c mod p. One scan of v m + p - 1 iterations; at iteration t, stage s works on
item k = t - s, which is micro-batch k mod m passing through its repeat r = k // m (chunk
r p + s). p = 2, v = 2, m = 3:

    iteration   0    1    2    3    4    5    6
    stage 0    a0   b0   c0   a1   b1   c1    .        a0 = micro-batch a, repeat 0
    stage 1     .   a0   b0   c0   a1   b1   c1

Activations move one stage forward each iteration with a ring `lax.ppermute`; what leaves the
last stage before its last repeat re-enters stage 0 m iterations after it entered (so v > 1
needs m >= p). Slots where t - s is outside [0, v m) are the bubble, a fraction
(p - 1) / (v m + p - 1) of the stage-iterations: their inputs are replaced by zeros before
any computation (`where`, never a multiplication), so nothing they hold reaches the results
or the gradients.

The backward is autodiff's: every micro-batch's activations (and each iteration's chunk
weights) stay alive until it, so memory grows with m; the outputs of all m micro-batches are
summed over `stage`. The 1F1B engine (parallel/pipeline.py) bounds both. The embedding, the
chunks' blocks and the head are the caller's functions (parallel/stage_functions.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel.rules import STAGE_AXIS, constrain
from mtnlg_jax.parallel.stage_functions import Inputs, shared_params

_STAGED = ('positions', 'segment_ids', 'loss_mask', 'row_keys', 'order')  # as the windows


def num_iterations(stages, repeats, micro_batches):
    return repeats * micro_batches + stages - 1


def bubble_fraction(stages, repeats, micro_batches):
    """Share of stage-iterations that hold no work: (p - 1) / (v m + p - 1)."""
    return (stages - 1) / num_iterations(stages, repeats, micro_batches)


@dataclasses.dataclass(frozen=True)
class GPipeEngine:
    """GPipe order over p > 1 stages, v repeats (engine.engine(config)'s for 'gpipe')."""

    stages: int
    repeats: int
    name = 'gpipe'
    pipelined = True
    block_grads_share = 1.0
    shared_grads_by_stage = False  # autodiff sums them over 'stage'

    def table(self, micro_batches):
        return None  # no table: autodiff orders the backward

    def ticks(self, micro_batches):
        return num_iterations(self.stages, self.repeats, micro_batches)

    def bubble_fraction(self, micro_batches):
        return bubble_fraction(self.stages, self.repeats, micro_batches)

    def loss_and_grads(self, stage_fns, params, batch):
        """(loss sum, token count, fp32 gradients, side values): autodiff of the pipelined
        loss plus the differentiable side values, in fp32 (the model casts each parameter to
        the compute dtype where it uses it, so the scans' transposes sum every iteration's
        gradient in fp32)."""
        params = jax.tree.map(lambda p: p.astype(jnp.float32), params)

        def objective(p):
            sums = pipelined_loss_sum(stage_fns, p, batch, stages=self.stages, repeats=self.repeats)
            return side.objective(stage_fns.values, sums[0], sums[2]), sums

        (_, (loss, count, values)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return loss, count, grads, values

    def loss_sum(self, stage_fns, params, batch):
        return pipelined_loss_sum(
            stage_fns, params, batch, stages=self.stages, repeats=self.repeats
        )


def summed_dtype(dtype):
    """The dtype x and the outputs cross `stage` in (the input's cotangent and the outputs are
    summed over it): fp32 for a 16-bit dtype on a CPU mesh, whose all-reduce-promotion pass
    aborts on a 16-bit all-reduce inside this partly manual shard_map ("Invalid binary
    instruction opcode copy": the reduction Shardy leaves ends in a copy); on GPUs the dtype's
    own. Only one stage's share of either sum is not zero, so fp32 changes no value."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    on_cpu = device is not None and device.platform == 'cpu'
    return jnp.float32 if on_cpu and jnp.dtype(dtype).itemsize < 4 else dtype


def from_last_stage(outputs, last):
    """Only the last stage holds the results: a sum over `stage` of them and zeros hands them
    to every stage."""
    kept = jnp.where(last, outputs, jnp.zeros_like(outputs))
    summed = jax.lax.psum(kept.astype(summed_dtype(kept.dtype)), STAGE_AXIS)
    return summed.astype(kept.dtype)


def run_pipeline(stage_fns, stacked, x, batch, *, stages, repeats, bubble_fill=0.0):
    """(the block stack over micro-batches x (m, rows, seq, embed), pipelined over 'stage',
    its side values combined over chunks, micro-batches and stages: a bubble iteration's are
    dropped by selection).

    stage_fns: the model's pieces (stage_functions.StageFunctions); stacked: the stage-major
    stacked block parameters (split over 'stage' on axis 0). batch: the MicroBatch of the m
    micro-batches, of which each chunk reads its micro-batch's dropout keys, positions and
    segment ids (indexed on every stage; the loss mask stays outside). bubble_fill: what the
    activation slots hold before real work reaches them (tests fill NaN to show it never
    leaks).
    """
    micro_batches = x.shape[0]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    per_chunk = num_layers // (stages * repeats)
    stage_spec = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), stacked)
    # what the blocks read (dropout keys, positions, segment ids): not the tokens, nor the loss
    batch = dataclasses.replace(batch, windows=None, loss_mask=None)
    batch_spec = batch.map(lambda _: PartitionSpec())

    declared = stage_fns.values

    def apply_chunk(chunk, h, micro_batch, first_layer, prepared):  # recomputed as a whole
        more = {} if prepared is None else {'prepared': prepared}  # chunk (below)
        y, values = stage_fns.apply_blocks(chunk, h, micro_batch, first_layer, 'none', **more)
        return y, side.detach(declared, values)

    if stage_fns.remat != 'none':
        apply_chunk = jax.checkpoint(apply_chunk, policy=stage_fns.remat_policy, prevent_cse=False)

    dtype = x.dtype

    def per_stage(local, x, batch):
        x = x.astype(dtype)
        stage = jax.lax.axis_index(STAGE_AXIS)

        # This stage's chunks, repeat-major: (v, L / (p v), ...).
        def by_repeat(tree):
            return jax.tree.map(lambda a: a.reshape(repeats, per_chunk, *a.shape[1:]), tree)

        chunks = by_repeat(local)
        # what the model prepares of the blocks once a step (FP8's quantized weights), each
        # iteration picking its chunk's as it picks the chunk's weights
        prepared = None if stage_fns.prepare is None else by_repeat(stage_fns.prepare(local))
        fill = jnp.full(x.shape[1:], bubble_fill, x.dtype)
        recirculating = jnp.full(x.shape, bubble_fill, x.dtype)  # stage 0: waiting for repeat
        outputs = jnp.zeros_like(x)  # last stage: finished micro-batches

        def iteration(carry, t):
            received, recirculating, outputs, values_sum = carry
            item = t - stage
            valid = (item >= 0) & (item < repeats * micro_batches)
            item = jnp.clip(item, 0, repeats * micro_batches - 1)
            repeat, micro = item // micro_batches, item % micro_batches
            # Stage 0 receives from the last stage what it finished an iteration ago: keep it
            # until its micro-batch comes round again for the next repeat.
            returned = t - stages
            keep = (stage == 0) & (returned >= 0) & (returned < (repeats - 1) * micro_batches)
            slot = jnp.clip(returned, 0, None) % micro_batches
            recirculating = jnp.where(keep, recirculating.at[slot].set(received), recirculating)
            first_input = jnp.where(repeat == 0, x[micro], recirculating[micro])
            h = jnp.where(stage == 0, first_input, received)
            h = jnp.where(valid, h, jnp.zeros_like(h))  # the bubble computes on zeros
            chunk, chunk_prepared = jax.tree.map(lambda a: a[repeat], (chunks, prepared))
            picked = batch.at(micro)
            inputs = Inputs(
                positions=picked.positions,
                segment_ids=picked.segment_ids,
                row_keys=picked.row_keys,
                order=picked.order,
            )
            first_layer = (repeat * stages + stage) * per_chunk
            y, values = apply_chunk(chunk, h, inputs, first_layer, chunk_prepared)
            values_sum = side.combine(declared, values_sum, side.where_ran(declared, valid, values))
            done = valid & (stage == stages - 1) & (repeat == repeats - 1)
            outputs = jnp.where(done, outputs.at[micro].set(y), outputs)
            ring = [(i, (i + 1) % stages) for i in range(stages)]
            received = jax.lax.ppermute(y, STAGE_AXIS, ring)
            return (received, recirculating, outputs, values_sum), None

        steps = jnp.arange(num_iterations(stages, repeats, micro_batches))
        init = (fill, recirculating, outputs, side.identities(declared))
        (_, _, outputs, values), _ = jax.lax.scan(iteration, init, steps)
        outputs = from_last_stage(outputs, stage == stages - 1)
        return outputs, side.over_axis(declared, values, STAGE_AXIS)

    run = jax.shard_map(
        per_stage,
        in_specs=(stage_spec, PartitionSpec(), batch_spec),
        out_specs=(PartitionSpec(), {name: PartitionSpec() for name in declared}),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    return run(stacked, x.astype(summed_dtype(dtype)), batch)


def pipelined_loss_sum(stage_fns, params, batch, *, stages, repeats):
    """(summed loss, token count, side values) of batch (MicroBatch of m micro-batches) under params
    (blocks stage-major), the block stack pipelined. Embedding, final norm and head run
    outside the pipeline; when p divides m, each stage takes m / p of the micro-batches, so
    none of that work is repeated on every stage (otherwise, as for MT-NLG's m = 240 over
    p = 35, every stage does all of it)."""
    micro_batches = batch.micro_batches
    split = stages if micro_batches % stages == 0 else 1
    stage_axes = ('stages',) if split > 1 else ()

    def by_stage(a):  # (m, ...) -> (m / split, split, ...), the split axis over 'stage'
        return a.reshape(micro_batches // split, split, *a.shape[1:])

    windows = constrain(by_stage(batch.windows), stage_axes + ('batch', 'window'))
    fields = {k: by_stage(getattr(batch, k)) for k in _STAGED if getattr(batch, k) is not None}
    staged = dataclasses.replace(batch, windows=windows, **fields)
    shared = shared_params(params)
    x = stage_fns.embed(shared, staged)
    x = constrain(x, stage_axes + ('batch', 'seq', 'embed'))
    x, values = run_pipeline(
        stage_fns,
        params['blocks'],
        x.reshape(micro_batches, *x.shape[2:]),
        batch,
        stages=stages,
        repeats=repeats,
    )
    x = constrain(by_stage(x), stage_axes + ('batch', 'seq', 'embed'))

    @jax.checkpoint  # keep `split` micro-batches' logits at a time, in the backward pass too
    def add_loss(total, hidden_and_inputs):
        hidden, inputs = hidden_and_inputs  # (split, rows, seq, ...): one per stage
        hidden = constrain(hidden, stage_axes + ('batch', 'seq', 'embed'))
        return total + stage_fns.logits_loss_sum(shared, hidden, inputs), None

    inputs = Inputs(labels=staged.labels, loss_mask=staged.loss_mask)
    total, _ = jax.lax.scan(add_loss, jnp.zeros((), jnp.float32), (x, inputs))
    return total, batch.token_count(), values
