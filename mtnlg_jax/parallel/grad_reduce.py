"""ZeRO-1's gradient reduce-scatter inside the pipeline's loop (pipeline.overlap_grad_reduce):
Megatron's --overlap-grad-reduce on the table engine (1f1b / interleaved, the tick by slot).

Without it every stage's fp32 block gradients leave the loop whole and one reduce-scatter over
'data' after it lands them on the ZeRO shards (parallel/zero.py), with nothing beside it. With
it a chunk's gradients are reduce-scattered once its last backward on the stage is done, a
layer at a time, each layer inside a later backward slot's computation:

    stage s, interleaved (v = 4): chunks finish 3, 2, 1, 0, p backward slots apart
    ... B(3, m-1) | B(2, .)+RS(3, layer 0) | B(2, .)+RS(3, layer 1) | B(2, .) ... | B(0, m-1)
    after the loop: RS of what no later slot took (chunk 0: the last to finish)

XLA:GPU's scheduler hides an asynchronous collective only behind work of its own computation
(docs/gpu.md): so the reduce-scatter is not a conditional of its own, nor in the tick's body
around the slot's conditional, but inside the backward branch itself, beside that chunk's
matmuls (the chunk's layers a loop inside it: unrolled, the 405B's tensor reduce-scatters
hid less, docs/benchmarks.md "ZeRO-1 inside the step"). The backward switch gets a branch
per (chunk j run, chunk k, layer l reduced) the table uses (`Plan.variants`) besides one per
chunk; a column of the scan says which branch each (tick, stage) takes, and which chunk's
layer the slot's shard is written to. The shards are a carried buffer (a chunk's: (layers,
*the layer's ZeRO shard in zero.ShardLayout's view)), 1 / data of the accumulators.

A layer's reduce-scatter reads the chunk's fp32 accumulator as it is after its last backward,
so the sums are those the loop would hand out, reduced by the same collective: the optimizer
step is exact. Leaves too small to split (zero.ShardLayout.dim None), and those ZeRO splits
along the layers with 'stage' (a bias split over 'tensor': `whole`), are summed by an
all-reduce in the same place and leave whole (the state's sharding then takes each replica's
slice, no communication).

pipeline.overlap_param_gather (with the above), the mirror: the blocks' compute copy comes
into the engine as each replica's compute-dtype ZeRO shards; chunk 0 is all-gathered before
the loop (`gather_chunk`), and chunks 1..v-1 a layer at a time inside the forward branches of
the first ticks, those before any stage runs another chunk (`first_tick_of_later_chunks`),
which run chunk 0's forwards alone (parallel/gathering_tick.py, a scan of their own):

    stage s, interleaved (v = 4), ticks 0 .. p-1:
    idle ... | F(0, 0)+AG(1, layer 0) | F(0, 1)+AG(1, layer 1) | ... | F(0, .)+AG(3, layer 1)
    a stage with fewer forwards there than layers (the last ones) gathers the rest in its
    idle slots of those ticks; what finds no slot at all, before the loop

The forward's switch gets a branch per (forward or idle, chunk k, layer l) the plan uses
(`gather_plan`, the same Plan as the reduce-scatter's), a column of that scan says which each
(tick, stage) takes and which chunk's layer the slot writes into a carried buffer of the
gathered views; the second scan runs on the chunks so gathered: the same bf16 compute copy,
gathered by the same collective as zero.gather_compute_copy's.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mtnlg_jax.parallel import rules, zero
from mtnlg_jax.parallel.branches import (
    BACKWARD,
    CHUNK,
    FIRST,
    FORWARD,
    GATHER,
    LAST,
    REDUCE,
    SLOT_FIRST,
    SLOT_IDLE,
    SLOT_LAST,
    SLOT_MIDDLE,
    slot_kinds,
)
from mtnlg_jax.parallel.slots import write


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each chunk's layers are reduce-scattered (`plan`) or all-gathered (`gather_plan`).
    variants: ((head, k, l), ...), the slot's own work (`plan`: a backward of chunk head;
    `gather_plan`: chunk 0's forward or none) beside the collective of chunk k's layer l;
    branch (ticks, stages): the switch's branch (below a base, the slot's work alone; the
    base + a variant's index); chunk, layer (ticks, stages): the piece the slot writes (-1:
    none); after: ((k, l), ...) the layers some stage leaves to outside the loop; done (stages,
    v, layers): whether the loop did it there."""

    variants: tuple
    branch: np.ndarray
    chunk: np.ndarray
    layer: np.ndarray
    after: tuple
    done: np.ndarray

    def columns(self):
        return tuple(jnp.asarray(a, jnp.int32) for a in (self.branch, self.chunk, self.layer))


def plan(table, layers):
    """The Plan of a 1f1b / interleaved table (schedule.Schedule) of chunks of `layers` layers:
    on each stage, each chunk's layers (in the order the chunks finish) go to the first backward
    slots after the chunk's last one that run another chunk from its stash (SLOT_MIDDLE or
    SLOT_FIRST: the head's path of the last chunk is left alone), one layer a slot."""
    _, kinds = slot_kinds(table)
    v = table.repeats
    branch = np.where(table.bwd_repeat >= 0, table.bwd_repeat, 0).astype(np.int32)

    def pieces(s):
        ran = table.bwd_micro[:, s] >= 0
        last = {
            k: int(np.max(np.nonzero(ran & (table.bwd_repeat[:, s] == k))[0])) for k in range(v)
        }
        return [(last[k], k, n) for k in sorted(last, key=last.get) for n in range(layers)]

    def free(s):
        return [t for t in range(table.ticks) if kinds[t, s] in (SLOT_MIDDLE, SLOT_FIRST)]

    return _placed(branch, v, (table.stages, v, layers), pieces, free, table.bwd_repeat)


def gather_plan(table, layers):
    """pipeline.overlap_param_gather's Plan, of the ticks before first_tick_of_later_chunks
    (those that run chunk 0's forwards alone): on each stage, the layers of chunks 1..v-1
    (in order) go to its forward slots, then to its idle ones, one layer a slot. The forward's
    switch: branch 0 idle, 1 chunk 0's forward, 2 + a variant's index; a variant (ran, k, l):
    the slot's forward (ran 1) or none (0) beside the all-gather of chunk k's layer l."""
    warm = first_tick_of_later_chunks(table)
    ran = (slot_kinds(table)[0][:warm] != SLOT_IDLE).astype(np.int32)
    v = table.repeats

    def pieces(s):
        return [(-1, k, n) for k in range(1, v) for n in range(layers)]

    def free(s):
        return [t for t in range(warm) if ran[t, s]] + [t for t in range(warm) if not ran[t, s]]

    return _placed(ran, 2, (table.stages, v, layers), pieces, free, ran)


def _placed(branch, base, shape, pieces_of, free_of, head):
    """The Plan that puts each stage s's pieces (pieces_of(s): (after, k, l), in order) in its
    free slots (free_of(s): ticks, in order of preference), each in the first after `after`,
    one a slot: the slot's variant (head[t, s], k, l), its branch base + the variant's index
    (branch: each (tick, stage)'s branch where it takes none); shape (stages, v, layers)."""
    branch = branch.astype(np.int32)
    chunk, layer = np.full(branch.shape, -1, np.int32), np.full(branch.shape, -1, np.int32)
    done = np.zeros(shape, bool)
    variants, left = {}, set()
    for s in range(shape[0]):
        free = free_of(s)
        for after, k, n in pieces_of(s):
            slot = next((t for t in free if t > after), None)
            if slot is None:
                left.add((k, n))
                continue
            free.remove(slot)
            key = (int(head[slot, s]), k, n)
            branch[slot, s] = base + variants.setdefault(key, len(variants))
            chunk[slot, s], layer[slot, s], done[s, k, n] = k, n, True
    return Plan(tuple(variants), branch, chunk, layer, tuple(sorted(left)), done)


def fractions(table, plan, weights, where=None):
    """branches.branch_fractions' `weights` with those of the backward's switch (REDUCE: each
    branch's share of the backward slots that run) and of the conditionals inside it (as
    inside the chunk switch they replace; the head's cond(last) over the slots a chunk
    branch runs), for the plan's HLO inventory; where: of those slots alone, as
    branch_fractions' (a (ticks, stages) mask)."""
    pick = (lambda a: a) if where is None else (lambda a: np.asarray(a)[where])  # noqa: E731
    kinds, branch, chunk = pick(slot_kinds(table)[1]), pick(plan.branch), pick(plan.chunk)
    ran = kinds != SLOT_IDLE
    runs = max(int(ran.sum()), 1)
    branches = int(plan.branch.max()) + 1
    shares = [float((ran & (branch == b)).sum() / runs) for b in range(branches)]
    plain = ran & (chunk < 0)
    last = float((kinds == SLOT_LAST).sum() / max(int(plain.sum()), 1))
    inner = {
        (BACKWARD, REDUCE, *path[2:]): w
        for path, w in weights.items()
        if path[:2] == (BACKWARD, CHUNK) and len(path) > 2
    }
    return {
        **weights,
        **inner,
        (BACKWARD, REDUCE): shares,
        (BACKWARD, REDUCE, LAST): [1.0 - last, last],
    }


def gather_fractions(table, plan, weights, where=None):
    """`weights` with those of the first ticks' forward switch (gather_plan's; GATHER: each
    branch's share of those ticks' slots) and of the embedding's conditional inside chunk
    0's forward there; where: of those slots alone (a (ticks, stages) mask)."""
    warm = plan.branch.shape[0]
    mask = np.ones(plan.branch.shape, bool) if where is None else np.asarray(where)[:warm]
    branch, kinds = plan.branch[mask], slot_kinds(table)[0][:warm][mask]
    runs = max(int(branch.size), 1)
    shares = [float((branch == b).sum() / runs) for b in range(2 + len(plan.variants))]
    first = float((kinds == SLOT_FIRST).sum() / max(int((kinds != SLOT_IDLE).sum()), 1))
    return {**weights, (FORWARD, GATHER): shares, (FORWARD, GATHER, FIRST): [1.0 - first, first]}


def whole(lay):
    """Whether a block leaf's gradients are all-reduced, not reduce-scattered, here: too small
    to split, or split along the layers (which a layer's piece does not have)."""
    return lay.dim is None or lay.dim == 0


def _view_spec(lay, lead=0):
    """The PartitionSpec of a block leaf's view (unless `whole`) with `lead` leading layer axes
    (0: one layer, 1: a chunk), less the axes manual here."""
    spec = PartitionSpec(*lay.spec) if whole(lay) else lay.view_spec(with_data=False)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return PartitionSpec(*(rules._without(a, manual) for a in tuple(spec)[1 - lead :]))


def _manual(fn, views, layouts, lead):
    """fn(views) in a region manual over the mesh axes not manual here (views: a tree like
    `layouts` of block leaves' views with `lead` leading layer axes)."""
    specs = jax.tree.map(lambda lay: _view_spec(lay, lead), layouts, is_leaf=_is_layout)
    mesh = jax.sharding.get_abstract_mesh()
    names = set(mesh.axis_names) - set(mesh.manual_axes)
    if not names:
        return fn(views)
    return jax.shard_map(fn, in_specs=(specs,), out_specs=specs, axis_names=names, check_vma=False)(
        views
    )


def reduce_layer(acc, layer, layouts):
    """The sums over the replicas of layer `layer` (static) of a chunk's fp32 accumulators
    (a tree of (layers, ...) like `layouts`: zero.ShardLayout of the stored block leaves), on
    this replica's ZeRO shard, in the view (the leaf's ZeRO dimension as (groups, 1, rest));
    inside the region manual over the replicas and 'stage', in one manual over the rest."""
    views = jax.tree.map(lambda a, lay: _view(a[layer], lay), acc, layouts)

    def scatter(x, lay):
        if whole(lay):  # over the replicas alone: 'stage' leads a split along the layers
            return zero.psum(x, lay.stacked)
        if lay.data == 1 or np.prod([jax.lax.axis_size(a) for a in lay.axes]) == 1:
            return x
        return jax.lax.psum_scatter(x, rules.entry(lay.axes), scatter_dimension=lay.dim, tiled=True)

    return _manual(lambda views: jax.tree.map(scatter, views, layouts), views, layouts, 0)


def _view(x, lay):
    """One layer of a block leaf, in its layout's view unless `whole`."""
    return x if whole(lay) else lay.view(x, offset=-1)


def _is_layout(x):
    return isinstance(x, zero.ShardLayout)


def shard_buffers(chunks, layouts):
    """The carried shards: a tree per chunk of zeros shaped as reduce_layer's output, with the
    chunk's layers leading."""

    def buffer(a, lay):
        shape = jax.eval_shape(lambda a: _view(a[0], lay), a).shape
        if not whole(lay) and lay.data > 1:
            d = lay.dim  # the data axis of the layer's view
            shape = (*shape[:d], 1, *shape[d + 1 :])
        return jnp.zeros((a.shape[0], *shape), jnp.float32)

    return tuple(jax.tree.map(buffer, chunk, layouts) for chunk in chunks)


def no_piece(shards):
    """What a branch that reduces (gathers) nothing hands out: zeros of one layer's shards
    (gathered views)."""
    return jax.tree.map(lambda b: jnp.zeros(b.shape[1:], b.dtype), shards[0])


def write_piece(shards, chunk, layer, piece):
    """shards[chunk][layer] = piece (chunk -1: nothing written)."""
    return tuple(
        jax.tree.map(lambda b, x, k=k: write(b, layer, chunk == k, x), buffer, piece)
        for k, buffer in enumerate(shards)
    )


def finish(plan, index, acc_chunks, shards, layouts):
    """The stage's block gradients on the ZeRO shards, chunks concatenated in stored order:
    what the loop did not reduce (plan.after) reduced now, where this stage (index, traced)
    left it."""
    shards = _left_over(plan, index, shards, lambda k, n: reduce_layer(acc_chunks[k], n, layouts))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *shards)


def _left_over(plan, index, buffers, piece, first=0):
    """buffers (a tree a chunk, from chunk `first`) with piece(k, l) written at each layer
    plan.after names, where this stage (index, traced) left it to outside the loop."""
    buffers = list(buffers)
    done = jnp.asarray(plan.done)
    for k, n in plan.after:
        buffers[k - first] = jax.tree.map(
            lambda b, x, k=k, n=n: write(b, n, ~done[index, k, n], x),
            buffers[k - first],
            piece(k, n),
        )
    return tuple(buffers)


def gather_chunk(views, layouts):
    """pipeline.overlap_param_gather: a chunk's compute copy from this replica's compute-dtype
    ZeRO shards (views: a tree of (layers, *the leaf's view, the data axis 1) like `layouts`;
    a `whole` leaf comes gathered already), all-gathered over the replicas: the all-gather
    zero.gather_compute_copy runs before the step's region, here per chunk, inside the
    region manual over the replicas and 'stage', in one manual over the rest."""
    return unview_chunk(_gathered(views, layouts, 1), layouts)


def gather_layer(views, layer, layouts):
    """gather_chunk's of layer `layer` (static) of a chunk's views, left in the view (the data
    axis whole): what a gathering forward slot writes into gather_buffers'."""
    return _gathered(jax.tree.map(lambda x: x[layer], views), layouts, 0)


def _gathered(views, layouts, lead):
    """The views (`lead` leading layer axes) all-gathered over the replicas, in the view, a
    collective a leaf. (A layer's leaves concatenated into one or two all-gathers, XLA:GPU
    kept none in flight across the forward beside it, where it keeps two of the six a leaf:
    docs/benchmarks.md.)"""

    def gather(x, lay):
        if whole(lay) or lay.data == 1:
            return x
        return jax.lax.all_gather(x, rules.entry(lay.axes), axis=lay.dim + lead, tiled=True)

    return _manual(lambda views: jax.tree.map(gather, views, layouts), views, layouts, lead)


def unview_chunk(gathered, layouts):
    """A chunk's compute copy from its gathered views."""
    return jax.tree.map(lambda x, lay: x if whole(lay) else lay.unview(x), gathered, layouts)


def gather_buffers(plan, index, views, layouts):
    """The carried gathered views of chunks 1..v-1 (views: their ZeRO shards' views), zeros
    but for the layers plan.after leaves to before the loop, gathered here where this stage
    (index, traced) left them."""
    buffers = [
        jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), _gathered_shape(c, layouts))
        for c in views
    ]
    piece = lambda k, n: gather_layer(views[k - 1], n, layouts)  # noqa: E731
    return _left_over(plan, index, buffers, piece, first=1)


def _gathered_shape(views, layouts):
    return jax.eval_shape(lambda v: _gathered(v, layouts, 1), views)


# XLA's option for asynchronous collectives in flight at once (mtnlg_jax/xla/flags.py
# recommends 4 process-wide): the gathering ticks' forwards keep a layer's per-leaf all-gathers
# beside chunk 0's own tensor collectives, and at 4 XLA:GPU starts most of them after the
# forward (the 405B: 39 % of the all-gather hidden at 4, 67 % at 8; docs/benchmarks.md).
GATHER_COLLECTIVES_IN_FLIGHT = 8
OVERLAP_LIMIT_OPTION = 'xla_gpu_experimental_parallel_collective_overlap_limit'


def compiler_options(overlap_param_gather):
    """jax.jit's compiler_options for a train step (XLA:CPU ignores them): more collectives in
    flight where the gathering ticks run (pipeline.overlap_param_gather), else none."""
    return {OVERLAP_LIMIT_OPTION: GATHER_COLLECTIVES_IN_FLIGHT} if overlap_param_gather else {}


def first_tick_of_later_chunks(table):
    """The first tick any stage runs a chunk other than its first (a forward of repeat > 0 or
    any backward): before it only each stage's chunk 0 runs."""
    later = ((table.fwd_micro >= 0) & (table.fwd_repeat > 0)) | (table.bwd_micro >= 0)
    return int(np.nonzero(later.any(axis=1))[0][0])
