"""The reducing tick (pipeline.overlap_grad_reduce): the tick by slot (tick_by_slot.py) whose
backward's switch also picks the layer of a finished chunk its branch reduce-scatters
(grad_reduce.py, which draws where), written into the carried ZeRO shards: the reduce-scatter
inside the backward's own computation, beside that chunk's matmuls, where XLA:GPU's scheduler
can hide it.
"""

import functools

import jax

from mtnlg_jax.parallel import backward_slot, grad_reduce, tick_by_slot
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel.branches import BACKWARD, REDUCE, SLOT_IDLE


def tick(stage, carry, xs):
    """The scan's body: one tick of the table, xs (branches.Columns, every stage's row;
    grad_reduce.Plan.columns: each (tick, stage)'s branch, and the chunk and layer whose
    shard it writes), the carry the tick by slot's and the shards."""
    act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums, shards = carry
    columns, reduce_columns = xs
    row = jax.tree.map(lambda a: a[stage.index], columns)
    branch, chunk, layer = (a[stage.index] for a in reduce_columns)
    stash, grad_buf = tick_by_slot.receive(stage, row, act_in, grad_in, stash, grad_buf)
    bwd = row.backward
    fetched, resids = stage.residual_slots.fetch(resids, bwd.resid_slot)
    y, resids, values = tick_by_slot.forward(stage, row.forward, stash, resids)
    sums = (*sums[:3], stage.combine(sums[3], values))
    h, g, kept = backward_slot.slot_inputs(stage, bwd, stash, resids, grad_buf, fetched)
    idle = lambda: (stage.without_taps(stage.no_gradients()), grad_reduce.no_piece(shards))  # noqa: E731
    with jax.named_scope(BACKWARD):
        grads, piece = jax.lax.cond(
            bwd.kind == SLOT_IDLE,
            idle,
            lambda: pull_back(stage, bwd, branch, h, g, kept, sums[0], shards),
        )
    sums, dx, _ = backward_slot.add_gradients(stage, bwd, sums, grads)
    shards = grad_reduce.write_piece(shards, chunk, layer, piece)
    act_in, grad_in = tick_by_slot.send(stage, y, dx)
    return (act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums, shards), None


def pull_back(stage, bwd, branch, h, g, kept, acc_blocks, shards):
    """(pull_back's tuple, one layer's shards) through a switch on `branch`: chunk k's
    backward (k < v), or a variant's (j, k, l): chunk j's from its stash beside the
    reduce-scatter of chunk k's layer l, in one computation."""
    plan, layouts = stage.reduce
    d_values = side.cotangents(stage.fns.values)

    def plain(k):
        grads = stage.chunk_gradients(bwd, h, g, kept, stage.chunks[k], k)
        return stage.without_taps(grads), grad_reduce.no_piece(shards)

    def variant(j, k, n):
        grads = stage.stashed_gradients(stage.chunks[j], j, g, kept, d_values)
        return stage.without_taps(grads), grad_reduce.reduce_layer(acc_blocks[k], n, layouts)

    branches = [functools.partial(plain, k) for k in range(len(stage.chunks))]
    branches += [functools.partial(variant, *key) for key in plan.variants]
    with jax.named_scope(REDUCE):
        return jax.lax.switch(branch, branches)
