"""What each slot of a 1F1B table runs, and how often the engine's conditionals take each branch.

The engine (pipeline.py) runs every stage's slot of a tick through `lax.cond` on its kind:

    SLOT_IDLE    nothing (a bubble, or the last chunk's forward: its backward runs it)
    SLOT_FIRST   chunk 0 (the embedding first; its backward adds the embedding's gradient)
    SLOT_MIDDLE  a middle chunk (stage input from the stash)
    SLOT_LAST    the last chunk (its backward runs its forward, the head and the loss)

Named scopes wrap those conditionals. XLA keeps them in each conditional's op_name, so the
plan's HLO inventory (plan/hlo_module.py) weighs a branch by how often the table takes it
(`branch_fractions`) instead of counting every branch as taken.

Under pipeline.steady_tick (steady_tick.py) one switch, scope STEADY, replaces the slots'
conditionals: a branch per (forward chunk, backward chunk, last?) pair the table holds
(`steady_pairs`), weighted by its share of the slots.

`columns(table)` groups the table's per-(tick, stage) arrays as the engine's tick reads them:
Columns(forward: Forward, backward: Backward, arrivals: Arrivals, weights: Weights of the W
slot or None). Where the table splits the backward (zero_bubble.py), the backward slot is B,
the backward but for the kernels' gradients, whose taps it stashes (scope BACKWARD_INPUT), and
the W slot those gradients from the taps (scope WEIGHTS, parallel/taps.py).
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

from mtnlg_jax.parallel.schedule import IDLE

SLOT_IDLE, SLOT_FIRST, SLOT_MIDDLE, SLOT_LAST = range(4)
FORWARD, BACKWARD, EVAL, FIRST, LAST = (
    'pipeline_forward', 'pipeline_backward', 'pipeline_eval', 'pipeline_first', 'pipeline_last'
)  # fmt: skip
# lax.switch over a stage's chunks (interleaved), and cond(skip, pass through, add) of the
# fp32 accumulators of the chunks and of the shared parameters
BACKWARD_INPUT, WEIGHTS = 'pipeline_backward_input', 'pipeline_weights'
CHUNK, ACCUMULATE, ACCUMULATE_SHARED = (
    'pipeline_chunk', 'pipeline_accumulate', 'pipeline_accumulate_shared'
)  # fmt: skip
# the fused accumulation's cond(skip, pass through, backward + dW) of each chunk (chained.py)
BACKWARD_CHUNK = 'pipeline_backward_chunk'
# the steady tick's one switch over the (forward, backward) pairs a table holds (steady_pairs)
STEADY = 'pipeline_steady'
# pipeline.overlap_grad_reduce's switch over a backward's chunks and (chunk, reduce-scatter of a
# finished chunk's layer) variants (grad_reduce.py): its weights are grad_reduce.fractions'
REDUCE = 'pipeline_reduce_chunk'
# pipeline.overlap_param_gather's switch in the first ticks' forward over (idle, chunk 0's
# forward) and their variants beside a later chunk's layer's all-gather (gathering_tick.py)
GATHER = 'pipeline_gather_chunk'


def slot_kinds(table):
    """(fwd kinds, bwd kinds), each (ticks, stages) of SLOT_IDLE, _FIRST, _MIDDLE, _LAST; a
    table that splits the backward adds its W slots' kinds."""
    stage = np.arange(table.stages)[None, :]

    def kinds(micro, repeat):
        first = (stage == 0) & (repeat == 0)
        last = (stage == table.last_stage) & (repeat == table.repeats - 1)
        kind = np.where(first, SLOT_FIRST, np.where(last, SLOT_LAST, SLOT_MIDDLE))
        return np.where(micro == IDLE, SLOT_IDLE, kind).astype(np.int32)

    fwd = kinds(table.fwd_micro, table.fwd_repeat)
    both = np.where(fwd == SLOT_LAST, SLOT_IDLE, fwd), kinds(table.bwd_micro, table.bwd_repeat)
    return (*both, kinds(table.w_micro, table.w_repeat)) if table.split else both


def branch_fractions(table, where=None):
    """{scope path: [fraction of its runs each branch takes]} of the engine's conditionals, the
    mean over stages, for the HLO inventory (plan/hlo.py). `lax.cond(pred, a, b)` lowers to
    branches [b, a]: branch 1 is the predicate's. Paths are the scopes enclosing a
    conditional, outermost first; a branch's fraction is of the runs of its enclosing code.
    where: a (ticks, stages) bool mask, the mean over those slots alone (slots alike: the
    branches one such slot takes; plan/lockstep.py prices each tick so); None: every slot."""
    pick = (lambda a: a) if where is None else (lambda a: np.asarray(a)[where])  # noqa: E731
    fwd, bwd, *w = map(pick, slot_kinds(table))
    slots = fwd.size

    def share(kinds, kind, of=None):
        base = (kinds != SLOT_IDLE).sum() if of is None else of
        return float((kinds == kind).sum() / base) if base else 0.0

    fwd_idle, bwd_idle = share(fwd, SLOT_IDLE, slots), share(bwd, SLOT_IDLE, slots)
    first_f, first_b = share(fwd, SLOT_FIRST), share(bwd, SLOT_FIRST)
    last_b = share(bwd, SLOT_LAST)
    touched = share(bwd, SLOT_FIRST, slots) + share(bwd, SLOT_LAST, slots)
    v = table.repeats
    add = (1.0 - bwd_idle) / v  # each chunk has the same number of backwards

    def chunk_shares(kinds, repeat):  # switch branch k: chunk k's share of the slots that run
        ran = kinds != SLOT_IDLE
        return [float((ran & (repeat == k)).sum() / max(ran.sum(), 1)) for k in range(v)]

    weights = {
        (FORWARD,): [1.0 - fwd_idle, fwd_idle],  # cond(idle, fill, run)
        (FORWARD, FIRST): [1.0 - first_f, first_f],  # cond(first, embed, hand-off)
        (BACKWARD,): [1.0 - bwd_idle, bwd_idle],
        (BACKWARD, FIRST): [1.0 - first_b, first_b],
        (BACKWARD, LAST, FIRST): [1.0 - first_b, first_b],  # the VJP inside cond(last, ...)
        (BACKWARD, LAST): [1.0 - last_b, last_b],  # cond(last, head, gradient in)
        (EVAL, LAST): [1.0 - share(bwd, SLOT_LAST, slots), share(bwd, SLOT_LAST, slots)],
        (FORWARD, CHUNK): chunk_shares(fwd, pick(table.fwd_repeat)),
        (BACKWARD, CHUNK): chunk_shares(bwd, pick(table.bwd_repeat)),
        (EVAL, LAST, CHUNK): [0.0] * (v - 1) + [1.0],  # the last chunk's loss
        (ACCUMULATE,): [add, 1.0 - add],  # cond(skip, pass through, add): [add, skip]
        (ACCUMULATE_SHARED,): [touched, 1.0 - touched],
    }
    weights.update(steady_fractions(table, first_f, pick))
    weights.update(chained_fractions(bwd, v))
    if w:  # B runs the backward's conditionals (the whole backward but the taps' kernels)
        for path in [p for p in weights if p[0] == BACKWARD]:
            weights[(BACKWARD_INPUT, *path[1:])] = weights.pop(path)
        w_idle = share(w[0], SLOT_IDLE, slots)
        w_ran = (1.0 - w_idle) / v  # a cond(idle or another chunk's, pass through, dW) a chunk
        weights[(WEIGHTS,)] = [w_ran, 1.0 - w_ran]
    # the conditionals inside a chunk's switch (interleaved): the same shares
    inner = [p for p in weights if p[0] in (FORWARD, BACKWARD) and len(p) > 1 and CHUNK not in p]
    for path in inner:
        weights[(path[0], CHUNK, *path[1:])] = weights[path]
    return weights


def chained_fractions(bwd, v):
    """The fused accumulation's conditionals with several chunks (parallel/chained.py), each
    cond(skip, pass through, run) = [run, skip]: a chunk's backward from its stash (v of them
    a tick; the embedding's cond inside it), and the head's (the last chunk: never chunk 0)."""
    ran, last, first = (
        (bwd != SLOT_IDLE).sum(),
        (bwd == SLOT_LAST).sum(),
        (bwd == SLOT_FIRST).sum(),
    )
    stashed = float((ran - last) / (v * bwd.size))  # a chunk's link runs, of its ticks
    first = float(first / max(ran - last, 1))  # of the links that ran
    head = float(last / bwd.size)
    return {
        (BACKWARD_CHUNK,): [stashed, 1.0 - stashed],
        (BACKWARD_CHUNK, FIRST): [1.0 - first, first],
        (BACKWARD_CHUNK, LAST): [head, 1.0 - head],
        (BACKWARD_CHUNK, LAST, FIRST): [1.0, 0.0],
    }


def steady_pairs(table):
    """(keys, index): the steady tick's switch (pipeline.steady_tick, steady_tick.py) has a branch
    per key (forward repeat, backward repeat, backward is the last chunk's), a repeat -1
    where the slot is idle, for each pair some (tick, stage) of the table holds; index
    (ticks, stages) says which. The layer work of a branch's two slots runs unconditionally,
    one computation, so XLA's scheduler can hide one slot's collectives under the other's
    matmuls; only the embedding's input (chunk 0) stays a conditional inside."""
    fwd, bwd, *_ = slot_kinds(table)
    f = np.where(fwd == SLOT_IDLE, -1, table.fwd_repeat)
    b = np.where(bwd == SLOT_IDLE, -1, table.bwd_repeat)
    pairs = np.stack([f, b, (bwd == SLOT_LAST).astype(np.int64)], axis=-1)
    keys, index = np.unique(pairs.reshape(-1, 3), axis=0, return_inverse=True)
    keys = tuple(tuple(int(k) for k in key) for key in keys)
    return keys, index.reshape(fwd.shape).astype(np.int32)


def steady_fractions(table, first_f, pick=lambda a: a):
    """The steady tick's conditionals' weights: each pair's share of the slots (those `pick`
    keeps of the (ticks, stages) index), and the embedding's cond inside (chunk 0's input:
    FIRST where the forward is stage 0's chunk 0; never in the last chunk's head path)."""
    keys, index = steady_pairs(table)
    index = pick(index)
    shares = [float((index == k).mean()) for k in range(len(keys))]
    return {
        (STEADY,): shares,
        (STEADY, FIRST): [1.0 - first_f, first_f],
        (STEADY, LAST, FIRST): [1.0, 0.0],
    }


class Forward(NamedTuple):
    """A tick's forward slot: its kind, micro-batch, repeat (the stage's chunk), the stash slot
    of its input and the residual slot it writes."""

    kind: Any
    micro: Any
    repeat: Any
    slot: Any
    resid_slot: Any


class Backward(NamedTuple):
    """A tick's backward slot: kind, micro-batch, repeat, the stash slot of the last chunk's
    input, the residual slot it reads and the gradient slot of its output's gradient."""

    kind: Any
    micro: Any
    repeat: Any
    slot: Any
    resid_slot: Any
    grad_slot: Any


class Weights(NamedTuple):
    """A split backward's W slot: its kind, repeat (the stage's chunk), the tap slot it reads
    and the tap slot the tick's B writes (parallel/taps.py)."""

    kind: Any
    repeat: Any
    tap_slot: Any
    b_tap_slot: Any


class Arrivals(NamedTuple):
    """What the tick's start receives: the stash slot an activation goes to and whether one
    arrives (act), the same for a gradient; in the V a second Arrivals, of the way back
    (schedule.Schedule.v_shape)."""

    act_slot: Any
    act: Any
    grad_slot: Any
    grad: Any


# Leaves in the order of their flat names: the engine's scan carries them in this order.
_FLAT = {
    'act': ('arrivals', 'act'),
    'bwd_grad_slot': ('backward', 'grad_slot'),
    'bwd_kind': ('backward', 'kind'),
    'bwd_micro': ('backward', 'micro'),
    'bwd_repeat': ('backward', 'repeat'),
    'bwd_resid_slot': ('backward', 'resid_slot'),
    'bwd_slot': ('backward', 'slot'),
    'fwd_kind': ('forward', 'kind'),
    'fwd_micro': ('forward', 'micro'),
    'fwd_repeat': ('forward', 'repeat'),
    'fwd_resid_slot': ('forward', 'resid_slot'),
    'fwd_slot': ('forward', 'slot'),
    'grad': ('arrivals', 'grad'),
    'recv_act_slot': ('arrivals', 'act_slot'),
    'recv_grad_slot': ('arrivals', 'grad_slot'),
}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Columns:
    """The table's columns in groups, (ticks, stages) each, or one stage's row of them."""

    forward: Forward
    backward: Backward
    arrivals: Arrivals
    weights: Weights = None  # the W slot of a split backward (B in `backward`), or None
    back: Arrivals = None  # the V's arrivals of the way back, or None

    def tree_flatten(self):
        leaves = [getattr(getattr(self, group), name) for group, name in _FLAT.values()]
        leaves += list(self.weights or ()) + list(self.back or ())
        return leaves, (self.weights is not None, self.back is not None)

    @classmethod
    def tree_unflatten(cls, present, leaves):
        fields = {'forward': {}, 'backward': {}, 'arrivals': {}}
        for (group, name), leaf in zip(_FLAT.values(), leaves):
            fields[group][name] = leaf
        rest = leaves[len(_FLAT) :]
        w = Weights(*rest[: len(Weights._fields)]) if present[0] else None
        back = Arrivals(*rest[len(Weights._fields) if present[0] else 0 :]) if present[1] else None
        return cls(Forward(**fields['forward']), Backward(**fields['backward']),
                   Arrivals(**fields['arrivals']), w, back)  # fmt: skip


def columns(table):
    """The Columns of a Schedule: kinds from slot_kinds, IDLE slots indexing 0 (unused)."""
    fwd_kind, bwd_kind, *w_kind = slot_kinds(table)
    used = lambda a: np.maximum(a, 0)  # noqa: E731
    t = table
    weights = back = None
    if t.split:
        weights = Weights(w_kind[0], *map(used, (t.w_repeat, t.w_tap_slot, t.bwd_tap_slot)))
    if t.v_shape:
        back = _arrivals(t.recv_act_back_slot, t.recv_grad_back_slot)
    return Columns(
        Forward(fwd_kind, *map(used, (t.fwd_micro, t.fwd_repeat, t.fwd_slot, t.fwd_resid_slot))),
        Backward(
            bwd_kind,
            *map(used, (t.bwd_micro, t.bwd_repeat, t.bwd_slot, t.bwd_resid_slot, t.bwd_grad_slot)),
        ),  # fmt: skip
        _arrivals(t.recv_act_slot, t.recv_grad_slot),
        weights,
        back,
    )


def _arrivals(act_slot, grad_slot):
    """Arrivals of two recv columns: slots (IDLE indexing 0) and whether anything arrives."""
    return Arrivals(
        np.maximum(act_slot, 0), act_slot >= 0, np.maximum(grad_slot, 0), grad_slot >= 0
    )
