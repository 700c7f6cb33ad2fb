"""The tick by slot: the body of the 1F1B / interleaved engine's scan over the table's rows
(pipeline.py; branches.Columns, this stage's row of them), each slot a conditional of its own,
on the stage's chunks and shared parameters (stage.Stage). Every stage runs the same program;
`lax.cond` on each slot's kind (branches.py) picks what it computes, so an idle slot costs
nothing, and (interleaved) a `lax.switch` on the slot's chunk runs it on that chunk's weights
where they lie. The other ticks, steady_tick.py's and reducing_tick.py's, run this one's
hand-offs (`receive`, `send`) and its forward slot (`forward`, the reducing one):

    arrivals -> stash[act_slot], grads[grad_slot]            (last tick's ppermute)
    forward  (y, vals), vjp = jax.vjp(chunk, stash[slot])   chunk 0: chunk(embed(tokens))
             resids[resid_slot] = vjp's residuals   last chunk: nothing (see backward)
             side values += vals (the identities where idle)
    backward vjp = from resids[resid_slot]          cotangent (grads[grad_slot], 1 for a
                                                    differentiable side value, else 0)
             last chunk: (y, vals), vjp = jax.vjp(chunk, stash[slot]), then final norm,
             head, loss; the loss's gradient is the cotangent; side values += vals
             fp32 accumulators += parameter gradients;   dx = gradient of the stage input
             (the conditionals return gradients; each chunk's accumulators, and the shared
             ones, are updated after them, in place, by a conditional that skips them unless
             the slot ran that chunk: a conditional that hands a buffer through its false
             branch has XLA:GPU copy it, through its true branch not); under
             pipeline.fused_accumulation the kernels' gradients leave the VJP as their taps
             (taps.py: x, dy, gathered in B), contracted in fp32 in that add: the dW
             GEMM's epilogue (Stage.fused); several chunks, by slot: a conditional a chunk
             (chained.py), its dW GEMMs in its backward's computation but QKV's
    y -> stage s + 1, dx -> stage s - 1 (rings), split over 'tensor' along the sequence;
    in the V (zero_bubble_v.py) both also the other way, the turn on stage p - 1 local

The backward slot is backward_slot.py's (a split backward's B there too, and W in a slot of
its own, after it).

The carry of the scan: (act_in, grad_in (in the V pairs, each way's), stash, resids,
grad_buf, tap_bufs ([] unless split; fused, several chunks, by slot: chained.scratch),
sums), sums = (fp32 block accumulators, one tree (L / (p v), ...) a chunk, fp32 shared
accumulators, loss, side values: {name: fp32 array}, empty when the model declares none);
the reducing tick's carries the ZeRO shards after them.
"""

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel import backward_slot
from mtnlg_jax.parallel.branches import FORWARD, SLOT_IDLE, SLOT_LAST
from mtnlg_jax.parallel.rules import STAGE_AXIS, constrain
from mtnlg_jax.parallel.slots import write


def tick(stage, carry, columns):
    """The scan's body: one tick of the table (branches.Columns, every stage's row)."""
    act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums = carry
    row = jax.tree.map(lambda a: a[stage.index], columns)
    stash, grad_buf = receive(stage, row, act_in, grad_in, stash, grad_buf)
    fetched, resids = stage.residual_slots.fetch(resids, row.backward.resid_slot)
    y, resids, values = forward(stage, row.forward, stash, resids)
    sums = (*sums[:3], stage.combine(sums[3], values))  # the forward's side values
    if row.weights is None or not stage.with_grads:
        sums, dx, tap_bufs = backward_slot.backward(
            stage, row.backward, sums, stash, resids, grad_buf, tap_bufs, fetched
        )
    else:  # a split backward: B, then W (which may be another micro-batch's)
        slot = row.weights.b_tap_slot
        sums, dx, tap_bufs = backward_slot.backward_input(
            stage, row.backward, slot, sums, stash, resids, grad_buf, tap_bufs, fetched
        )
        sums = backward_slot.weights(stage, row.weights, sums, tap_bufs)
    act_in, grad_in = send(stage, y, dx)
    return (act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums), None


def forward(stage, fwd, stash, resids, pick=None):
    """One chunk's forward (branches.Forward): (y to the next stage, resids with its
    residuals in resids[fwd.resid_slot], its side values: the identities where the slot
    is idle, as the last chunk's is: its backward slot runs it). pick: None, or
    pick(idle, run) -> (what the one that runs returns, more): the slot's own conditional
    (gathering_tick.py's), `more` then returned after the side values."""

    def run_chunk(chunk, repeat):
        return stage.forward_chunk(chunk, repeat, fwd, stash[fwd.slot])

    def run():
        return stage.on_chunk(fwd.repeat, run_chunk)

    def idle():
        return stage.idle_forward()

    with jax.named_scope(FORWARD):
        if pick is None:
            out, more = jax.lax.cond(fwd.kind == SLOT_IDLE, idle, run), None
        else:
            out, more = pick(idle, run)
    (y, values), kept = out
    ran = (fwd.kind != SLOT_IDLE) & (fwd.kind != SLOT_LAST)
    resids = written(stage, resids, fwd.resid_slot, ran, kept)
    return (y, resids, values) if pick is None else (y, resids, values, more)


def written(stage, resids, slot, ran, kept):
    """The residual buffers with a forward's kept residuals in `slot` where it ran."""
    return stage.residual_slots.write(resids, slot, ran, kept)


def receive(stage, row, act_in, grad_in, stash, grad_buf):
    """Last tick's hand-offs into the slots the table gives them (in the V, act_in and
    grad_in are pairs: the way down's and the way back's)."""
    if row.back is None:
        ways = [(row.arrivals, act_in, grad_in)]
    else:
        ways = zip((row.arrivals, row.back), act_in, grad_in)
    for arrivals, act, grad in ways:
        stash = write(stash, arrivals.act_slot, arrivals.act, act)
        grad_buf = write(grad_buf, arrivals.grad_slot, arrivals.grad, grad)
    return stash, grad_buf


def send(stage, y, dx):
    """(act_in, grad_in) of the next tick: y to stage s + 1, dx to s - 1 (rings). In the
    V both go both ways: y down for the first chunk and back up for the second, dx the
    opposite; on stage p - 1 the way back starts with its own y and dx (the turn)."""
    p = stage.stages
    if not stage.v_shape:
        act_in = handoff(stage, y, [(i, (i + 1) % p) for i in range(p)])
        grad_in = handoff(stage, dx, [(i, (i - 1) % p) for i in range(p)])
        return act_in, grad_in
    down, up = [(i, i + 1) for i in range(p - 1)], [(i + 1, i) for i in range(p - 1)]
    turn = stage.index == p - 1

    def turned(x):
        return jnp.where(turn, constrain(x, stage.handoff_axes), handoff(stage, x, up))

    return (handoff(stage, y, down), turned(y)), (turned(dx), handoff(stage, dx, down))


def handoff(stage, x, ring):
    return jax.lax.ppermute(constrain(x, stage.handoff_axes), STAGE_AXIS, ring)
