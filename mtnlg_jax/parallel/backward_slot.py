"""A backward slot of the engine's tick: what it reads, the chunk's gradients through the VJP
its forward kept (stage.Stage's), added to the fp32 accumulators in place; a split backward's
B and W. Free functions of a stage.Stage, as chained.py's; every tick runs its backward slot
through them (tick_by_slot.py, steady_tick.py, reducing_tick.py).

The conditionals return gradients; each chunk's accumulators, and the shared ones, are updated
after them, in place, by a conditional that skips them unless the slot ran that chunk: a
conditional that hands a buffer through its false branch has XLA:GPU copy it, through its true
branch not.

    one chunk a stage  cond(idle, hand acc through, pull back; acc + the gradients)
    several            cond(idle, zeros, pull back) -> the gradients; then, chunk k:
                       cond(idle or another chunk's slot, hand acc_k through, acc_k + them)
    fused, several     chained.py: a conditional a chunk, its dW GEMMs in its backward's
    shared             cond(neither chunk 0's slot nor the last's, hand through, + d_shared)
    evaluation         cond(the last chunk's slot, its forward, head and loss, nothing)

Under pipeline.fused_accumulation the kernels' gradients leave the VJP as their taps (taps.py:
x, dy, gathered in B), contracted in fp32 in the accumulators' add: the dW GEMM's epilogue.

A split backward (zero_bubble.py) runs B in the backward slot, the backward but for the
kernels' weight gradients, whose taps (parallel/taps.py) go into tap_bufs[b_tap_slot], and W
in a slot of its own: dW = x^T dy from tap_bufs[tap_slot], added to the accumulators.
"""

import functools

import jax

from mtnlg_jax.parallel import chained, taps
from mtnlg_jax.parallel.branches import (
    ACCUMULATE,
    BACKWARD,
    BACKWARD_INPUT,
    EVAL,
    LAST,
    SLOT_IDLE,
    SLOT_LAST,
    WEIGHTS,
)
from mtnlg_jax.parallel.slots import add, add_unless, read, write


def backward(stage, bwd, sums, stash, resids, grad_buf, tap_bufs, fetched=None):
    """One chunk's backward (branches.Backward) through the VJP its forward kept; the last
    chunk runs its forward here, then final norm, head and loss, whose gradient starts the
    VJP. Without gradients: the last chunk's loss only. Returns (sums, dx, tap_bufs)."""
    h, g, kept = slot_inputs(stage, bwd, stash, resids, grad_buf, fetched)
    if not stage.with_grads:
        with jax.named_scope(EVAL), jax.named_scope(LAST):
            return *jax.lax.cond(
                bwd.kind == SLOT_LAST,
                lambda: stage.loss_only(bwd, sums, h),
                lambda: (sums, stage.fill),
            ), tap_bufs
    if len(stage.chunks) == 1:
        return *backward_one_chunk(stage, bwd, sums, h, g, kept)[:2], tap_bufs
    if stage.fused:  # a conditional a chunk, its dW GEMMs beside its backward's
        return chained.backward(stage, bwd, sums, h, g, kept, tap_bufs)
    return backward_chunks(stage, bwd, sums, h, g, kept)


def slot_inputs(stage, bwd, stash, resids, grad_buf, fetched=None):
    """(the last chunk's stashed input, the output's gradient, the residuals) a backward
    slot reads: the slot's residuals read here, since a conditional handed the whole
    buffers would copy them (XLA:CPU does); a slice is what the branch needs. fetched:
    offload.Slots.fetch's, read from host buffers as the tick started (None: read here)."""
    kept = stage.residual_slots.read(resids, bwd.resid_slot, fetched)
    return stash[bwd.slot], grad_buf[bwd.grad_slot], kept


def backward_one_chunk(stage, bwd, sums, h, g, kept, scope=BACKWARD):
    """One chunk a stage: its accumulators are added to inside the backward's conditional,
    whose idle (true) branch hands them through, so an idle tick writes no zero gradient
    of the chunk's size. The shared accumulators stay outside it: added to in a nested
    conditional, XLA:GPU copies them in the outer one. Returns (sums, the input's
    gradient, the taps: [] unless split)."""
    acc_blocks, acc_shared, loss, acc_values = sums

    def idle(acc):
        *rest, tapped = stage.no_gradients()[1:]
        return acc, *rest, [] if stage.fused else tapped

    def run(acc):
        d_chunk, *rest, tapped = stage.pull_back(bwd, h, g, kept)
        if stage.fused:  # the taps used here, in B's branch
            return add_chunk(stage, acc, (d_chunk, tapped)), *rest, []
        return add_chunk(stage, acc, d_chunk), *rest, tapped

    with jax.named_scope(scope):
        acc, d_shared, value, values, dx, tapped = jax.lax.cond(
            bwd.kind == SLOT_IDLE, idle, run, acc_blocks[0]
        )
    acc_shared = stage.add_shared(bwd, acc_shared, d_shared)
    return ((acc,), acc_shared, loss + value, stage.combine(acc_values, values)), dx, tapped


def backward_chunks(stage, bwd, sums, h, g, kept, scope=BACKWARD):
    """Several chunks a stage: the conditional returns this tick's gradients, never the
    accumulators (handed through one, XLA:GPU copies every fp32 accumulator in both
    branches, every tick); each chunk's are added to after it, where the slot ran that
    chunk. Split, the tapped kernels' gradients are W's: left out. Returns (sums, the
    input's gradient, the taps: [] unless split)."""
    with jax.named_scope(scope):
        grads = jax.lax.cond(
            bwd.kind == SLOT_IDLE,
            lambda: stage.without_taps(stage.no_gradients()),
            lambda: stage.without_taps(stage.pull_back(bwd, h, g, kept)),
        )
    return add_gradients(stage, bwd, sums, grads)


def add_gradients(stage, bwd, sums, grads):
    """(sums + a backward slot's gradients (pull_back's tuple), the input's gradient, its
    taps): each chunk's accumulators in place unless the slot ran another (split: all but
    the tapped kernels', W's)."""
    d_chunk, d_shared, value, values, dx, tapped = grads
    acc_blocks, acc_shared, loss, acc_values = sums
    idle = bwd.kind == SLOT_IDLE
    if stage.fused:  # the taps as B gathered them: no accumulator's conditional holds a
        # collective (XLA:GPU then hides the hand-offs behind the dW GEMMs)
        d_chunk = (d_chunk, taps.hold(tapped, stage.sites))
    with jax.named_scope(ACCUMULATE):
        acc_blocks = tuple(
            add_unless(idle | (bwd.repeat != k), acc, d_chunk, functools.partial(add_chunk, stage))
            for k, acc in enumerate(acc_blocks)
        )
    acc_shared = stage.add_shared(bwd, acc_shared, d_shared)
    sums = (acc_blocks, acc_shared, loss + value, stage.combine(acc_values, values))
    return sums, dx, tapped


def add_chunk(stage, acc, d_chunk):
    """A chunk's accumulators + its gradients (split: but the tapped kernels', W's;
    fused: d_chunk is (the gradients, the taps), the kernels' contracted here)."""
    if stage.sites is None:
        return add(acc, d_chunk)
    if not stage.fused:
        return taps.add_untapped(acc, d_chunk, stage.sites)
    d_chunk, tapped = d_chunk
    acc = taps.add_untapped(acc, d_chunk, stage.sites)
    return taps.add_weight_grads(acc, stage.sites, tapped)


def backward_input(stage, bwd, slot, sums, stash, resids, grad_buf, tap_bufs, fetched=None):
    """A split backward's B (one chunk a stage): the whole backward through the VJP its
    forward kept, but for the tapped kernels' gradients: every other gradient added to
    sums, the chunk's taps (each kernel matmul's x and dy, taps.py) written into
    tap_bufs[slot] for W. Returns (sums, the input's gradient, tap_bufs)."""
    h, g, kept = slot_inputs(stage, bwd, stash, resids, grad_buf, fetched)
    chunks = backward_one_chunk if len(stage.chunks) == 1 else backward_chunks
    sums, dx, tapped = chunks(stage, bwd, sums, h, g, kept, BACKWARD_INPUT)
    ran = bwd.kind != SLOT_IDLE
    tap_bufs = jax.tree.map(lambda b, t: write(b, slot, ran, t), tap_bufs, tapped)
    tap_bufs = taps.hold(tap_bufs, stage.sites)  # a stream tap as its sequence shard
    return sums, dx, tap_bufs


def weights(stage, w, sums, tap_bufs):
    """A split backward's W (branches.Weights): the tapped kernels' gradients from the taps
    B stashed, dW = x^T dy per matmul (taps.add_weight_grads), added to the chunk's
    accumulators inside the conditional (its idle, true, branch hands them through)."""
    acc_blocks, *rest = sums
    # behind a barrier: without it XLA:GPU gave two tap buffers the dW matmuls' operand
    # layout and copied each every tick (tests/test_loop_copies.py)
    stashed = jax.tree.map(lambda b: read(b, w.tap_slot), tap_bufs)
    stashed = jax.lax.optimization_barrier(stashed)  # [(x, dy) or (dy,)] per site

    def run(acc):
        return taps.add_weight_grads(acc, stage.sites, stashed)

    def skip(k):  # two chunks a stage (the V): where the slot ran another chunk too
        idle = w.kind == SLOT_IDLE
        return idle if len(acc_blocks) == 1 else idle | (w.repeat != k)

    with jax.named_scope(WEIGHTS):
        acc_blocks = tuple(
            jax.lax.cond(skip(k), lambda acc: acc, run, acc) for k, acc in enumerate(acc_blocks)
        )
    return (acc_blocks, *rest)
