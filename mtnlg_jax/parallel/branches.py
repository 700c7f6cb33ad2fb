"""What each slot of a 1F1B table runs, and how often the engine's conditionals take each branch.

The engine (pipeline.py) runs every stage's slot of a tick through `lax.cond` on its kind:

    SLOT_IDLE    nothing (a bubble, or the last chunk's forward: its backward runs it)
    SLOT_FIRST   chunk 0 (the embedding first; its backward adds the embedding's gradient)
    SLOT_MIDDLE  a middle chunk (stage input from the stash)
    SLOT_LAST    the last chunk (its backward runs its forward, the head and the loss)

Named scopes wrap those conditionals. XLA keeps them in each conditional's op_name, so the
plan's HLO inventory (plan/hlo_module.py) weighs a branch by how often the table takes it
(`branch_fractions`) instead of counting every branch as taken.
"""

import numpy as np

from mtnlg_jax.parallel.schedule import IDLE

SLOT_IDLE, SLOT_FIRST, SLOT_MIDDLE, SLOT_LAST = range(4)
# A chunk's layer slot on a stage of unequal depth: run, or a padding slot passed through.
LAYER_SLOT = 'pipeline_layer_slot'
FORWARD, BACKWARD, EVAL, FIRST, LAST = (
    'pipeline_forward', 'pipeline_backward', 'pipeline_eval', 'pipeline_first', 'pipeline_last'
)  # fmt: skip


def slot_kinds(table):
    """(fwd kinds, bwd kinds), each (ticks, stages) of SLOT_IDLE, _FIRST, _MIDDLE, _LAST."""
    stage = np.arange(table.stages)[None, :]

    def kinds(micro, repeat):
        first = (stage == 0) & (repeat == 0)
        last = (stage == table.stages - 1) & (repeat == table.repeats - 1)
        kind = np.where(first, SLOT_FIRST, np.where(last, SLOT_LAST, SLOT_MIDDLE))
        return np.where(micro == IDLE, SLOT_IDLE, kind).astype(np.int32)

    fwd = kinds(table.fwd_micro, table.fwd_repeat)
    return np.where(fwd == SLOT_LAST, SLOT_IDLE, fwd), kinds(table.bwd_micro, table.bwd_repeat)


def branch_fractions(table):
    """{scope path: [fraction of its runs each branch takes]} of the engine's conditionals, the
    mean over stages, for the HLO inventory (plan/hlo.py). `lax.cond(pred, a, b)` lowers to
    branches [b, a]: branch 1 is the predicate's. Paths are the scopes enclosing a
    conditional, outermost first; a branch's fraction is of the runs of its enclosing code."""
    fwd, bwd = slot_kinds(table)
    slots = fwd.size

    def share(kinds, kind, of=None):
        base = (kinds != SLOT_IDLE).sum() if of is None else of
        return float((kinds == kind).sum() / base) if base else 0.0

    fwd_idle, bwd_idle = share(fwd, SLOT_IDLE, slots), share(bwd, SLOT_IDLE, slots)
    first_f, first_b = share(fwd, SLOT_FIRST), share(bwd, SLOT_FIRST)
    last_b = share(bwd, SLOT_LAST)
    return {
        (FORWARD,): [1.0 - fwd_idle, fwd_idle],  # cond(idle, fill, run)
        (FORWARD, FIRST): [1.0 - first_f, first_f],  # cond(first, embed, hand-off)
        (BACKWARD,): [1.0 - bwd_idle, bwd_idle],
        (BACKWARD, FIRST): [1.0 - first_b, first_b],
        (BACKWARD, LAST): [1.0 - last_b, last_b],  # cond(last, head, gradient in)
        (EVAL, LAST): [1.0 - share(bwd, SLOT_LAST, slots), share(bwd, SLOT_LAST, slots)],
    }
