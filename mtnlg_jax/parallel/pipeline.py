"""The 1F1B / interleaved engine over the mesh axis 'stage': loss and explicit gradients.

`TableEngine` is what `engine.engine(config)` returns for `pipeline.schedule` 1f1b or
interleaved with mesh.stage > 1: a static table (parallel/schedule.py) says, for every tick and
stage, which forward and which backward to run; one `lax.scan` over the ticks inside
`jax.shard_map` manual over 'stage' runs it, the scan's body being a stage's tick (`tick_of`:
parallel/tick_by_slot.py, which draws the tick, or steady_tick.py, reducing_tick.py). Memory
is flat in m. The model's pieces come in as functions (parallel/stage_functions.py: the
engines import nothing from the model), every micro-batch's inputs as a MicroBatch.

A forward keeps what its chunk's backward needs, the residuals of its VJP under
`model.remat` (every layer's kept values with remat none, the named matmul outputs with
selective, each layer's input with full), in a slot per micro-batch in flight; the backward
applies that VJP, so no chunk runs its forward twice and a pipelined step does the matmul
FLOPs of the same model unpipelined. The parameters inside a VJP are not stashed: the
backward puts the current chunk's back (parallel/residuals.py), and so what the model
prepares of a chunk once a step, before the scan (stage_functions.StageFunctions.prepare:
FP8's quantized weights), a loop-invariant input of every tick. The residuals' layout is
probed once, before the scan. The embedding runs on the first stage, the final norm, head and
loss on the last, one micro-batch a tick; only the loss is summed over 'stage', and the
gradients of the parameters outside the block stack (each stage holds them all) are summed
over 'stage': the tied embedding's two halves meet there, from the first stage and the last.

Stored form: block parameters stage-major (parallel/stage_order.py), so the rule 'layers' ->
'stage' gives each stage exactly its own chunks.

The functions of layout keywords (loss_and_grads, loss_sum, num_ticks, bubble_fraction) serve
tests and benches that name a layout without a config; the train step, banner, reporter and
planner ask `engine.engine(config)`.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mtnlg_jax.parallel import chained, gpipe, grad_reduce, taps, zero_bubble, zero_bubble_v
from mtnlg_jax.parallel import gathering_tick, offload, reducing_tick, steady_tick, tick_by_slot
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel import schedule as schedule_lib
from mtnlg_jax.parallel.branches import columns as table_columns
from mtnlg_jax.parallel.branches import steady_pairs
from mtnlg_jax.parallel.residuals import probe_layout
from mtnlg_jax.parallel.rules import STAGE_AXIS, constrain
from mtnlg_jax.parallel.stage import ACTIVATION_AXES, Stage
from mtnlg_jax.parallel.stage_functions import MicroBatch, shared_params

SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zbh1', 'zbv')
HANDOFF_AXES = ('batch', 'handoff_seq', 'embed')  # split over 'tensor' along the sequence


def options(config):
    """The keywords of a config's pipeline: stages, repeats, schedule, max_in_flight,
    steady_tick, fused_accumulation (a run saved before pipeline.schedule existed is GPipe)."""
    return dict(
        stages=config.mesh.stage,
        repeats=config.pipeline.repeats,
        schedule=config.pipeline.get('schedule', 'gpipe'),
        max_in_flight=config.pipeline.get('max_in_flight', 0),
        steady_tick=config.pipeline.get('steady_tick', False),
        fused_accumulation=config.pipeline.get('fused_accumulation', False),
        overlap_grad_reduce=config.pipeline.get('overlap_grad_reduce', False),
        overlap_param_gather=config.pipeline.get('overlap_param_gather', False),
    )


def build_table(stages, repeats, micro_batches, max_in_flight=0, schedule='1f1b'):
    """The 1f1b / interleaved table (schedule.build), zbh1's (zero_bubble.build: one chunk
    a stage) or zbv's (zero_bubble_v.build: two chunks a stage in a V); max_in_flight 0: no
    bound."""
    if schedule == 'zbh1':
        return zero_bubble.build(stages, micro_batches, max_in_flight or None)
    if schedule == 'zbv':
        return zero_bubble_v.build(stages, micro_batches, max_in_flight or None)
    return schedule_lib.build(stages, repeats, micro_batches, max_in_flight or None)


@dataclasses.dataclass(frozen=True)
class TableEngine:
    """1F1B (repeats 1) or interleaved 1F1B (repeats > 1) over p > 1 stages; schedule 'zbh1':
    ZB-H1, the backward split into B and W slots (zero_bubble.py); 'zbv': ZB-V, the same with
    two chunks a stage in a V (zero_bubble_v.py)."""

    stages: int
    repeats: int
    max_in_flight: int = 0
    stage_layers: Any = None  # stage_order.StageLayers of unequal stages (None: equal)
    schedule: str = '1f1b'  # or 'interleaved' (the same), 'zbh1', 'zbv'
    # the tick as one switch over its (forward, backward) pairs (steady_tick.py)
    steady_tick: bool = False
    # the weight gradients contracted in the accumulators' add (stage.Stage.fused)
    fused_accumulation: bool = False
    # ZeRO-1's reduce-scatter of the block gradients inside the loop (grad_reduce.py): the
    # block gradients leave loss_and_grads on the ZeRO shards, in zero.ShardLayout's view
    overlap_grad_reduce: bool = False
    # with it: the blocks' compute copy comes as ZeRO shards, chunk 0 all-gathered in the
    # engine before the loop, chunks 1.. a layer at a time inside the forwards of the ticks
    # that run only chunk 0 (gathering_tick.py)
    overlap_param_gather: bool = False
    pipelined = True
    shared_grads_by_stage = True  # each stage's own share, stacked (scan_ticks)

    @property
    def block_grads_share(self):
        return 1.0 / self.repeats  # a tick's backward differentiates one chunk (stage.py)

    @property
    def head_stage(self):
        """The stage that runs the head (schedule.Schedule.last_stage): 0 in the V."""
        return 0 if self.schedule == 'zbv' else self.stages - 1

    @property
    def name(self):
        name = 'interleaved 1F1B' if self.repeats > 1 else '1f1b'
        name = {
            'zbh1': 'zbh1 (ZB-H1: B and W slots)',
            'zbv': 'zbv (ZB-V: two chunks a stage in a V, B and W slots)',
        }.get(self.schedule, name)
        if self.max_in_flight:
            held = 'micro-batches' if self.repeats > 1 else 'stage inputs'
            if self.schedule != 'zbv' and self.repeats > 1 and self.max_in_flight > self.stages:
                # schedule.py: above p, stage 0's chunk inputs
                held = f"micro-batches' chunk inputs ({self.max_in_flight * self.repeats})"
            name += f' (at most {self.max_in_flight} {held} in flight)'
        return name + (', steady tick' if self.steady_tick else '')

    def table(self, micro_batches):
        return build_table(
            self.stages, self.repeats, micro_batches, self.max_in_flight, self.schedule
        )

    def ticks(self, micro_batches):
        return self.table(micro_batches).ticks

    def bubble_fraction(self, micro_batches):
        """Share of the step the stages wait, from the table's ticks (a backward costing 2
        forwards)."""
        return float(self.table(micro_batches).bubble_fraction())

    def loss_and_grads(self, stage_fns, params, batch, grad_layouts=None):
        """(loss sum, token count, fp32 gradients shaped as params, side values) of batch
        (MicroBatch of m micro-batches), the block stack pipelined over 'stage'. params:
        compute-dtype, blocks stage-major. Called by the train step inside its region manual
        over 'data' (one replica's rows); at top level with both 'data' and 'tensor' larger
        than 1, XLA's SPMD partitioner aborts on the embedding's scatter-add. grad_layouts:
        under overlap_grad_reduce, the block leaves' zero.ShardLayouts: the block gradients
        come summed over the replicas on this replica's ZeRO shards, in the layouts' view
        (the data axis 1)."""
        table = self.table(batch.micro_batches)
        return run_table(
            stage_fns,
            params,
            batch,
            table,
            True,
            stage_layers=self.stage_layers,
            steady_tick=self.steady_tick,
            fused_accumulation=self.fused_accumulation,
            grad_layouts=grad_layouts if self.overlap_grad_reduce else None,
            gather_params=self.overlap_grad_reduce and self.overlap_param_gather,
        )

    def loss_sum(self, stage_fns, params, batch):
        """(loss sum, token count, side values), pipelined, no gradients."""
        table = self.table(batch.micro_batches)
        loss, count, _, values = run_table(
            stage_fns, params, batch, table, False, stage_layers=self.stage_layers
        )
        return loss, count, values


def engine_for(stages, repeats, schedule='1f1b', max_in_flight=0, stage_layers=None, **ticks):
    """The engine of a pipelined layout (stages > 1): GPipe's or the table's (ticks:
    steady_tick, fused_accumulation)."""
    if schedule == 'gpipe':
        return gpipe.GPipeEngine(stages, repeats)
    return TableEngine(stages, repeats, max_in_flight, stage_layers, schedule, **ticks)


def num_ticks(stages, repeats, micro_batches, schedule='1f1b', max_in_flight=0):
    """Scan length: table ticks (1f1b / interleaved / zbh1), iterations v m + p - 1 (gpipe)."""
    return engine_for(stages, repeats, schedule, max_in_flight).ticks(micro_batches)


def bubble_fraction(stages, repeats, micro_batches, schedule='1f1b', max_in_flight=0):
    """Predicted share of the step the stages wait (0 without stages)."""
    if stages == 1:
        return 0.0
    return engine_for(stages, repeats, schedule, max_in_flight).bubble_fraction(micro_batches)


def loss_and_grads(stage_fns, params, tokens, row_keys, **layout):
    """(loss sum, token count, fp32 gradients, side values) of tokens (m, rows, seq + 1),
    row_keys (m, rows) or None, under layout (stages, repeats, schedule, max_in_flight,
    steady_tick)."""
    batch = MicroBatch(tokens, row_keys=row_keys)
    return engine_for(**layout).loss_and_grads(stage_fns, params, batch)


def loss_sum(stage_fns, params, tokens, **layout):
    """(loss sum, token count, side values) of tokens (m, rows, seq + 1), pipelined, no
    gradients."""
    return engine_for(**layout).loss_sum(stage_fns, params, MicroBatch(tokens))


def run_schedule(
    stage_fns,
    params,
    tokens,
    row_keys,
    table,
    with_grads,
    bubble_fill=0.0,
    stage_layers=None,
    steady_tick=False,
):
    """run_table of token windows (m, rows, seq + 1) and their dropout keys (or None)."""
    batch = MicroBatch(tokens, row_keys=row_keys)
    return run_table(
        stage_fns, params, batch, table, with_grads, bubble_fill, stage_layers, steady_tick
    )


def run_table(
    stage_fns,
    params,
    batch,
    table,
    with_grads,
    bubble_fill=0.0,
    stage_layers=None,
    steady_tick=False,
    fused_accumulation=False,
    grad_layouts=None,
    gather_params=False,
):
    """Run `table` (schedule.Schedule) over batch (MicroBatch); returns (loss sum, token count,
    fp32 grads or None, side values: stage_fns.values combined over chunks, micro-batches and
    stages). bubble_fill: what empty slots and idle outputs hold (tests fill NaN:
    it never leaks); stage_layers: a StageLayers of stages of unequal depth (None: equal);
    steady_tick: with gradients, the tick as one switch over its slot pairs (steady_tick.py);
    fused_accumulation: unsplit, the weight gradients contracted in the accumulators' add;
    grad_layouts: the block leaves' zero.ShardLayouts, to reduce-scatter the block gradients
    inside the loop (grad_reduce.py; None: they leave it as each replica's sums);
    gather_params: with grad_layouts, params['blocks'] holds this replica's compute-dtype ZeRO
    shards (grad_reduce.gather_chunk's views): chunk 0 gathered here, before the loop, the
    others a layer at a time inside the forwards of the first ticks, which run only chunk 0
    (gathering_tick.py), in a scan of their own before the rest's."""
    shared = shared_params(params)
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(mesh.shape).get('tensor', 1)
    handoff_axes = HANDOFF_AXES if batch.seq % tensor == 0 else ACTIVATION_AXES

    def per_stage(blocks, shared, batch):
        chunks, warm = _chunks(blocks, table, grad_layouts if gather_params else None)
        # the steady tick's layers unrolled: a while loop per chunk would keep the forward's
        # and the backward's collectives in computations of their own
        unroll = with_grads and steady_tick
        stage = _stage_of(
            stage_fns, chunks, shared, batch, table, bubble_fill, stage_layers, unroll,
            handoff_axes,
        )  # fmt: skip
        pair_index = None
        if with_grads:
            stage, pair_index = _for_gradients(
                stage, table, steady_tick, fused_accumulation, grad_layouts
            )
        return scan_ticks(stage, table, bubble_fill, pair_index, warm)

    return _over_stages(per_stage, params, shared, batch, stage_fns, with_grads)


@dataclasses.dataclass(frozen=True)
class Warm:
    """pipeline.overlap_param_gather's first ticks (gathering_tick.py): how many, where they
    gather which layer (grad_reduce.gather_plan), the ZeRO shards' views of chunks 1.."""

    ticks: int
    plan: Any
    views: tuple


def _chunks(blocks, table, gathered):
    """(this stage's chunks of the stacked blocks, Warm or None); with `gathered` (the
    leaves' ShardLayouts) the blocks are ZeRO shards' views: chunk 0 gathered here, in
    every chunk's place until the gathering ticks have gathered the others."""
    v = table.repeats
    per_chunk = jax.tree.leaves(blocks)[0].shape[0] // v
    stacked = jax.tree.map(lambda a: a.reshape(v, per_chunk, *a.shape[1:]), blocks)
    chunks = tuple(jax.tree.map(lambda a: a[k], stacked) for k in range(v))
    if gathered is None:
        return chunks, None
    first = grad_reduce.gather_chunk(chunks[0], gathered)
    if v == 1:
        return (first,), None
    plan = grad_reduce.gather_plan(table, per_chunk)
    warm = Warm(grad_reduce.first_tick_of_later_chunks(table), plan, chunks[1:])
    return (first,) * v, warm


def _stage_of(
    stage_fns, chunks, shared, batch, table, bubble_fill, stage_layers, unroll, handoff_axes,
):  # fmt: skip
    """This stage's Stage inside shard_map on its chunks, the fill of idle slots."""
    p = table.stages
    embedded = jax.eval_shape(lambda sh, b: stage_fns.embed(sh, b.at(0)), shared, batch)
    return Stage(
        fns=stage_fns,
        chunks=chunks,
        shared=shared,
        batch=batch,
        index=jax.lax.axis_index(STAGE_AXIS),
        stages=p,
        per_chunk=jax.tree.leaves(chunks[0])[0].shape[0],
        fill=jnp.full((batch.rows, batch.seq, embedded.shape[-1]), bubble_fill, stage_fns.dtype),
        layout=None,
        handoff_axes=handoff_axes,
        stage_layers=stage_layers,
        split=table.split,
        v_shape=table.v_shape,
        unroll=unroll,
    ).with_chunks(chunks)


def _for_gradients(stage, table, steady, fused_accumulation, grad_layouts):
    """(stage, the residuals' shapes, the tick's pair index or None) of a step with gradients:
    the taps B hands W (or the accumulators' add contracts), the residuals' layout probed on
    chunk 0, and the reducing or steady tick's pairing."""
    zero = jnp.zeros((), jnp.int32)
    chunk = stage.chunks[0]
    # B hands W each kernel matmul's taps (taps.py); not split, B's own branch or the
    # accumulators' add contracts them (Stage.fused), held as the matmuls had them
    fused = fused_accumulation and not table.split
    if table.split or fused:
        sites = taps.probe(stage.apply, chunk, stage.fill, zero, 0, [])
        sites = taps.as_read(sites) if fused else sites
        stage = dataclasses.replace(stage, sites=sites, fused=fused)
    first = functools.partial(stage.forward_with_residuals, repeat=0)  # chunk 0, static
    kept_shapes, layout = probe_layout(first, chunk, zero, stage.fill, zero)
    hosted = (False,) * len(kept_shapes)
    if stage.fns.offload:  # which residuals model.remat_offload's names leave
        offloading = functools.partial(first, offload=True)
        hosted = offload.hosted(offloading, chunk, zero, stage.fill, zero)
        assert len(hosted) == len(kept_shapes), 'the offloading policy kept another layout'
    stage = dataclasses.replace(
        stage, layout=layout, residual_slots=offload.Slots(kept_shapes, hosted)
    )
    pair_index = None
    if grad_layouts is not None:
        reduce = grad_reduce.plan(table, stage.per_chunk)
        stage = dataclasses.replace(stage, reduce=(reduce, grad_layouts))
        pair_index = reduce.columns()
    elif steady:
        keys, pair_index = steady_pairs(table)
        stage = dataclasses.replace(stage, pairs=keys)
    return stage, pair_index


def _over_stages(per_stage, params, shared, batch, stage_fns, with_grads):
    """per_stage in shard_map manual over 'stage': (loss sum, token count, grads or None,
    side values)."""
    stage_spec = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), params['blocks'])
    shared_spec = jax.tree.map(lambda _: PartitionSpec(), shared)
    by_stage = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), shared)
    batch_spec = batch.map(lambda _: PartitionSpec())
    summed = (PartitionSpec(), {name: PartitionSpec() for name in stage_fns.values})
    run = jax.shard_map(
        per_stage,
        in_specs=(stage_spec, shared_spec, batch_spec),
        out_specs=(*summed, stage_spec, by_stage) if with_grads else summed,
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    results = run(params['blocks'], shared, batch)
    count = batch.token_count()
    if not with_grads:
        return results[0], count, None, results[1]
    loss, values, block_grads, shared_grads = results
    return loss, count, {**shared_grads, 'blocks': block_grads}, values


def scan_ticks(stage, table, bubble_fill, pair_index=None, warm=None):
    """The scan over the table's ticks on one stage; (loss, side values) or (loss, side
    values, fp32 block grads in stored form, fp32 shared grads), the loss and the values
    combined over 'stage', the shared grads this stage's own share (stacked over 'stage'
    outside: zero.reduce_scatter sums them). pair_index: the steady tick's (ticks, stages)
    branch of each slot pair (branches.steady_pairs), or None; warm: a Warm, whose gathering
    ticks scan first (the stage's chunks all chunk 0 until then), or None."""
    rows, seq, hidden = stage.fill.shape
    if stage.residual_slots is None:  # without gradients: no residuals
        stage = dataclasses.replace(stage, residual_slots=offload.Slots([], ()))

    def buffer(slots):
        return constrain(
            jnp.full((slots, rows, seq, hidden), bubble_fill, stage.fill.dtype), stage.handoff_axes
        )

    def fill(dtype):  # a residual slot's before its first write
        return bubble_fill if jnp.issubdtype(dtype, jnp.floating) else 0

    zeros32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
    declared = stage.fns.values
    no_values = side.identities(declared)
    sums = (zeros32(stage.chunks), zeros32(stage.shared), jnp.zeros((), jnp.float32), no_values)

    def tap_buffer(a):  # a slot per micro-batch between its B and its W
        return jnp.full((table.tap_slots, stage.per_chunk, *a.shape), bubble_fill, a.dtype)

    sites = () if stage.fused else stage.sites or ()  # fused: no buffers, W in B's tick
    arrived = constrain(stage.fill, stage.handoff_axes)
    arrived = (arrived, arrived) if table.v_shape else arrived  # the V: both ways
    init = (
        arrived,
        arrived,
        buffer(table.stash_slots),
        stage.residual_slots.buffers(table.resid_slots, fill),  # a slot a micro-batch in flight
        buffer(table.grad_slots),
        taps.hold([tuple(map(tap_buffer, s.arrays())) for s in sites], sites)
        or chained.scratch(stage),
        sums,
    )
    if stage.reduce is not None:
        init = (*init, grad_reduce.shard_buffers(stage.chunks, stage.reduce[1]))
    xs = jax.tree.map(jnp.asarray, table_columns(table))
    if pair_index is not None:
        xs = (xs, jax.tree.map(jnp.asarray, pair_index))
    if warm is not None:  # the gathering ticks first, then the rest on every chunk
        init, stage = gathering_tick.run(stage, init, xs[0], warm)
        xs = jax.tree.map(lambda a: a[warm.ticks :], xs)
    carry, _ = jax.lax.scan(tick_of(stage), init, xs)
    acc_blocks, acc_shared, loss, values = carry[6]
    loss = jax.lax.psum(loss, STAGE_AXIS)
    values = side.over_axis(declared, values, STAGE_AXIS)
    if not stage.with_grads:
        return loss, values
    if stage.reduce is not None:  # on the ZeRO shards (grad_reduce.py)
        plan, layouts = stage.reduce
        acc_blocks = grad_reduce.finish(plan, stage.index, acc_blocks, carry[7], layouts)
    else:
        acc_blocks = jax.tree.map(lambda *a: jnp.concatenate(a), *acc_blocks)
    return (loss, values, acc_blocks, jax.tree.map(lambda a: a[None], acc_shared))


def tick_of(stage):
    """The scan's body on a stage.Stage, (carry, the tick's columns) -> (carry, None): the
    steady tick where stage.pairs is set, the reducing tick where stage.reduce is, else the
    tick by slot."""
    if stage.pairs is not None:
        return functools.partial(steady_tick.tick, stage)
    if stage.reduce is not None:
        return functools.partial(reducing_tick.tick, stage)
    return functools.partial(tick_by_slot.tick, stage)
