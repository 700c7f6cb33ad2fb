"""The steady tick (pipeline.steady_tick, with gradients): the 1F1B / interleaved engine's tick
(pipeline.py) as one `lax.switch` per tick over the (forward chunk, backward chunk, last
chunk's backward) pairs the table holds (branches.steady_pairs), each branch running both
slots' layer work, unrolled, in one computation, with no conditional around either: XLA's
scheduler orders a computation on its own, so a forward's tensor collectives can then hide
under the other micro-batch's backward matmuls, and back. Idle slots are branches of their
own (the schedule's edges); chunk 0's embedding stays a cond inside (stage.Stage.input). The
hand-offs and W are the tick by slot's (tick_by_slot.py, backward_slot.py; the V's both ways
included).
"""

import functools

import jax

from mtnlg_jax.parallel import backward_slot, tick_by_slot
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel.branches import LAST, SLOT_IDLE, SLOT_LAST, STEADY
from mtnlg_jax.parallel.slots import read, write


def tick(stage, carry, xs):
    """The scan's body: one tick of the table, xs (branches.Columns, every stage's row; the
    pair index, (ticks, stages)). What the slots return is written and added outside the
    switch, as the tick by slot does."""
    act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums = carry
    columns, pairs = xs
    row = jax.tree.map(lambda a: a[stage.index], columns)
    stash, grad_buf = tick_by_slot.receive(stage, row, act_in, grad_in, stash, grad_buf)
    fwd, bwd = row.forward, row.backward
    x = read(stash, fwd.slot)
    h, g, kept = backward_slot.slot_inputs(stage, bwd, stash, resids, grad_buf)
    branches = [
        functools.partial(pair, stage, key, fwd, bwd, x, h, g, kept, resids) for key in stage.pairs
    ]
    with jax.named_scope(STEADY):
        (y, values), kept_f, grads = jax.lax.switch(pairs[stage.index], branches)
    ran = (fwd.kind != SLOT_IDLE) & (fwd.kind != SLOT_LAST)
    resids = tick_by_slot.written(stage, resids, fwd.resid_slot, ran, kept_f)
    sums = (*sums[:3], stage.combine(sums[3], values))  # the forward's side values
    sums, dx, tapped = backward_slot.add_gradients(stage, bwd, sums, grads)
    if row.weights is not None:  # B wrote the taps; W (its own cond) reads them
        ran = bwd.kind != SLOT_IDLE
        slot = row.weights.b_tap_slot
        tap_bufs = jax.tree.map(lambda b, t: write(b, slot, ran, t), tap_bufs, tapped)
        sums = backward_slot.weights(stage, row.weights, sums, tap_bufs)
    act_in, grad_in = tick_by_slot.send(stage, y, dx)
    return (act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums), None


def pair(stage, key, fwd, bwd, x, h, g, kept, resids):
    """A steady branch: ((y, side values), the forward's residuals, pull_back's tuple) of
    key's forward (chunk f, -1: idle) and backward (chunk b, the head's when `last`)."""
    f, b, last = key
    out = stage.idle_forward() if f < 0 else stage.forward_chunk(stage.chunks[f], f, fwd, x)
    d_values = side.cotangents(stage.fns.values)
    if b < 0:
        grads = stage.no_gradients()
    elif not last:
        grads = stage.stashed_gradients(stage.chunks[b], b, g, kept, d_values)
    else:
        with jax.named_scope(LAST):
            grads = stage.head_gradients(stage.chunks[b], b, bwd, h, d_values)
    return (*out, stage.without_taps(grads))
