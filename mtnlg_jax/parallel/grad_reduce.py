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

pipeline.overlap_param_gather (with the above): the blocks' compute copy comes into the engine
as each replica's compute-dtype ZeRO shards and `gather_chunk` all-gathers it a chunk at a
time; the engine splits its loop where the ticks that run only chunk 0 end
(`first_tick_of_later_chunks`), so that chunks 1.. are needed only by the second loop. On the
405B XLA:GPU still ran those all-gathers before the first loop (docs/gpu.md): inside chunk 0's
forward branches, as the reduce-scatter is inside the backward's, is what would hide them.
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
    """Where each chunk's layers are reduce-scattered. variants: ((j, k, l), ...), a backward
    of chunk j beside the reduce-scatter of chunk k's layer l; branch (ticks, stages): the
    backward switch's branch (the chunk, < v, or v + a variant's index); chunk, layer (ticks,
    stages): the shard the slot writes (-1: none); after: ((k, l), ...) the layers some stage
    reduces after the loop; done (stages, v, layers): whether the loop reduced it there."""

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
    ticks, stages, v = table.ticks, table.stages, table.repeats
    branch = np.where(table.bwd_repeat >= 0, table.bwd_repeat, 0).astype(np.int32)
    chunk = np.full((ticks, stages), -1, np.int32)
    layer = np.full((ticks, stages), -1, np.int32)
    done = np.zeros((stages, v, layers), bool)
    variants = {}
    for s in range(stages):
        ran = table.bwd_micro[:, s] >= 0
        last = {
            k: int(np.max(np.nonzero(ran & (table.bwd_repeat[:, s] == k))[0])) for k in range(v)
        }
        pieces = [(last[k], k, n) for k in sorted(last, key=last.get) for n in range(layers)]
        free = [t for t in range(ticks) if kinds[t, s] in (SLOT_MIDDLE, SLOT_FIRST)]
        for finished, k, n in pieces:
            slot = next((t for t in free if t > finished), None)
            if slot is None:
                continue
            free.remove(slot)
            key = (int(table.bwd_repeat[slot, s]), k, n)
            branch[slot, s] = v + variants.setdefault(key, len(variants))
            chunk[slot, s], layer[slot, s], done[s, k, n] = k, n, True
    after = tuple((k, n) for k in range(v) for n in range(layers) if not done[:, k, n].all())
    return Plan(tuple(variants), branch, chunk, layer, after, done)


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


def whole(lay):
    """Whether a block leaf's gradients are all-reduced, not reduce-scattered, here: too small
    to split, or split along the layers (which a layer's piece does not have)."""
    return lay.dim is None or lay.dim == 0


def _piece_spec(lay):
    """The PartitionSpec of one layer of a block leaf's view, less the axes manual here."""
    spec = PartitionSpec(*lay.spec) if whole(lay) else lay.view_spec(with_data=False)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return PartitionSpec(*(rules._without(a, manual) for a in tuple(spec)[1:]))


def reduce_layer(acc, layer, layouts):
    """The sums over the replicas of layer `layer` (static) of a chunk's fp32 accumulators
    (a tree of (layers, ...) like `layouts`: zero.ShardLayout of the stored block leaves), on
    this replica's ZeRO shard, in the view (the leaf's ZeRO dimension as (groups, 1, rest));
    inside the region manual over the replicas and 'stage', in one manual over the rest."""
    views = jax.tree.map(lambda a, lay: _view(a[layer], lay), acc, layouts)
    specs = jax.tree.map(_piece_spec, layouts, is_leaf=_is_layout)
    mesh = jax.sharding.get_abstract_mesh()
    names = set(mesh.axis_names) - set(mesh.manual_axes)

    def scatter(x, lay):
        if whole(lay):  # over the replicas alone: 'stage' leads a split along the layers
            return zero.psum(x, lay.stacked)
        if lay.data == 1 or np.prod([jax.lax.axis_size(a) for a in lay.axes]) == 1:
            return x
        return jax.lax.psum_scatter(x, rules.entry(lay.axes), scatter_dimension=lay.dim, tiled=True)

    def reduce(views):
        return jax.tree.map(scatter, views, layouts)

    if not names:
        return reduce(views)
    return jax.shard_map(
        reduce, in_specs=(specs,), out_specs=specs, axis_names=names, check_vma=False
    )(views)


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
    """What a branch that reduces nothing hands out: zeros of one layer's shards."""
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
    shards = list(shards)
    done = jnp.asarray(plan.done)
    for k, n in plan.after:
        piece = reduce_layer(acc_chunks[k], n, layouts)
        shards[k] = jax.tree.map(
            lambda b, x, k=k, n=n: write(b, n, ~done[index, k, n], x), shards[k], piece
        )
    return jax.tree.map(lambda *a: jnp.concatenate(a), *shards)


def gather_chunk(views, layouts):
    """pipeline.overlap_param_gather: a chunk's compute copy from this replica's compute-dtype
    ZeRO shards (views: a tree of (layers, *the leaf's view, the data axis 1) like `layouts`;
    a `whole` leaf comes gathered already), all-gathered over the replicas: the all-gather
    zero.gather_compute_copy runs before the step's region, here per chunk, inside the
    region manual over the replicas and 'stage', in one manual over the rest."""
    specs = jax.tree.map(_chunk_spec, layouts, is_leaf=_is_layout)
    mesh = jax.sharding.get_abstract_mesh()
    names = set(mesh.axis_names) - set(mesh.manual_axes)

    def gather(x, lay):
        if whole(lay) or lay.data == 1:
            return x
        return jax.lax.all_gather(x, rules.entry(lay.axes), axis=lay.dim + 1, tiled=True)

    def gather_all(views):
        return jax.tree.map(gather, views, layouts)

    gathered = (
        gather_all(views)
        if not names
        else jax.shard_map(
            gather_all, in_specs=(specs,), out_specs=specs, axis_names=names, check_vma=False
        )(views)
    )
    return jax.tree.map(lambda x, lay: x if whole(lay) else lay.unview(x), gathered, layouts)


def _chunk_spec(lay):
    """The PartitionSpec of a chunk of a block leaf (its view unless `whole`), less the axes
    manual here."""
    spec = PartitionSpec(*lay.spec) if whole(lay) else lay.view_spec(with_data=False)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return PartitionSpec(*(rules._without(a, manual) for a in tuple(spec)))


def first_tick_of_later_chunks(table):
    """The first tick any stage runs a chunk other than its first (a forward of repeat > 0 or
    any backward): before it only each stage's chunk 0 runs."""
    later = ((table.fwd_micro >= 0) & (table.fwd_repeat > 0)) | (table.bwd_micro >= 0)
    return int(np.nonzero(later.any(axis=1))[0][0])
