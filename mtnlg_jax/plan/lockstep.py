"""The pipeline's lockstep ticks priced by their slowest stage: the bubble in the replayed step.

The overlap replay (plan/overlap.py) weighs each of the engine's conditionals by the share of
the slots that take each branch, a mean over stages and ticks: it replays an average stage,
with no bubble. The engine runs its ticks in lockstep (each ends in the stages' hand-off), so
a tick takes as long as its slowest stage. Here the pipeline loop's body is replayed once for
each kind of slot the table holds (the branches one such slot takes: branches.branch_fractions
with `where`), and each tick priced at its slowest stage's (a body of two ticks, XLA:GPU's
double-buffered loop, priced as two of half its time):

    replayed     ticks x body(the mean weights)                         plan/overlap.py
    lockstep     sum over ticks of  max over stages  body(that stage's slot)

What the second adds is the bubble the first leaves out: the ramps' and the in-flight bound's
idle slots, and a stage heavier than the others (the last stage's head and loss), priced as
the compiled program runs them, exposed communication included.
"""

import numpy as np

from mtnlg_jax.parallel import branches
from mtnlg_jax.plan import hlo_module


def slot_patterns(table, extra=()):
    """(count, index): the kinds of slot a table holds, alike where every conditional takes
    the same branches (the kinds and chunks of a tick's forward, backward and W, and `extra`
    (ticks, stages) columns), and which of them each (tick, stage) holds, (ticks, stages)."""
    columns = [*branches.slot_kinds(table), table.fwd_repeat, table.bwd_repeat, *extra]
    if table.split:
        columns.append(table.w_repeat)
    rows = np.stack([np.asarray(c) for c in columns], axis=-1).reshape(-1, len(columns))
    keys, index = np.unique(rows, axis=0, return_inverse=True)
    return len(keys), index.reshape(np.shape(columns[0]))


def pipeline_loop(computations, scope='pipeline_', without=None):
    """(computation holding it, the while instruction) of the pipeline's loop, the while whose
    body holds the engine's slot conditionals (op names with `scope`, none with `without`);
    None if there is none."""
    for name, instructions in computations.items():
        for instruction in instructions:
            if instruction.opcode != 'while':
                continue
            body = dict(instruction.callees())['body']
            names = [i.op_name() for i in computations.get(body, []) if i.opcode == 'conditional']
            if any(scope in n for n in names) and not (
                without and any(without in n for n in names)
            ):
                return name, instruction
    return None


def lockstep(replay, table, weights_of, extra=(), warm=0):
    """The replayed step with each tick at its slowest stage's slot:

        {'ticks', 'slot_kinds', 'mean_tick_s': one tick of the replay's average stage,
         'slots_mean_tick_s': the mean of every slot's own (the same, as the weights are),
         'lockstep_loop_s': the loop's ticks each at its slowest stage (x runs a step),
         'bubble_s': what that adds to the replayed step}

    or None without a pipeline loop. replay: collective_overlap's (overlap.Replay, run under
    the mean weights; reweighed here); weights_of(where): the branch weights of the slots
    `where` (a (ticks, stages) mask), as report.branch_weights gives; extra: (ticks, stages)
    columns that tell slots apart beyond the table's (the engine's other switches,
    report.slot_columns); warm: the first ticks that run in a loop of their own, the one
    that holds the forward's GATHER switch (pipeline.overlap_param_gather), 0: none."""
    parts = _loops(replay, table, warm)
    if parts is None:
        return None
    count, index = slot_patterns(table, extra)
    loop_s, bubble_s, per_slot = 0.0, 0.0, []
    for body, runs, unrolled, start, end, mean_tick in parts:
        tick_of_kind = np.zeros(count)
        for kind in np.unique(index[start:end]):
            replay.reweigh(weights_of(index == kind))
            tick_of_kind[kind] = replay.duration(body) / unrolled
        slowest = float(tick_of_kind[index[start:end]].max(axis=1).sum())
        loop_s += runs * slowest
        bubble_s += runs * (slowest - (end - start) * mean_tick)
        per_slot.append(tick_of_kind[index[start:end]])
    return dict(
        ticks=table.ticks,
        slot_kinds=count,
        mean_tick_s=parts[-1][-1],
        slots_mean_tick_s=float(np.concatenate(per_slot).mean()),
        lockstep_loop_s=loop_s,
        bubble_s=bubble_s,
    )


def _loops(replay, table, warm):
    """[(body, runs a step, ticks a trip, first tick, end, its tick under the mean weights)]
    of the pipeline's loops, in the order they run; None without one."""
    found = pipeline_loop(replay.computations, without=branches.GATHER if warm else None)
    if found is None:
        return None
    loops = [(found, warm, table.ticks)]
    if warm:
        loops.insert(0, (pipeline_loop(replay.computations, branches.GATHER), 0, warm))
    parts = []
    for (holder, loop), start, end in loops:
        body = dict(loop.callees())['body']
        # XLA:GPU's while-loop double buffering runs two ticks a trip (one more peeled if odd)
        trips = hlo_module.trip_count(loop, replay.computations) or 1
        unrolled = max(1, round((end - start) / trips))
        runs = replay.counts.get(holder, (1, False))[0]
        parts.append((body, runs, unrolled, start, end, replay.duration(body) / unrolled))
    return parts
