"""The ZB-V table (Qi et al., arXiv 2405.15362): two chunks a stage in a V, the backward split
into B and W slots as ZB-H1's (zero_bubble.py).

Stage s holds chunks s and 2p - 1 - s (stage_order.chunk_index): a micro-batch's forward runs
down the stages on its first chunks, turns on stage p - 1 (its chunk p - 1 hands chunk p its
output on the same stage) and runs back up on the second, so the loss lands on stage 0 beside
the embedding; its B's run the same way back. Every stage holds one chunk that a micro-batch
reaches early and one it reaches late, which evens out what the stages hold: a micro-batch
enters on stage 0 and leaves it last, and on stage p - 1 both its chunks sit in the middle
of its way. The table is built greedily, tick by tick, like ZB-H1's (a tick holds a forward,
a B and a W slot on every stage, hand-offs between ticks): per stage

    first  B if a gradient is here (stage 0: the last chunk's forward, empty, before it), the
           earliest micro-batch's (the second chunk's on a tie); a forward if one is here,
           the second chunk's first (it frees memory sooner), a new micro-batch's chunk 0
           only while fewer than `bound` are in the pipeline; W if p are put off
    then   more of the same, W's put off, while the stage's work stays within the tick's
           slowest stage's

Costs count a chunk's forward 1, B 1, W 1 (the last chunk's forward 0: its B's tick runs it,
with the head and the loss, so that B costs 2). A micro-batch is in the pipeline from its
chunk 0's forward to its last W: bounding that count (`pipeline.max_in_flight`, as the
interleaved table's) bounds every stage's memory at `bound` stage inputs (two chunk inputs of
half a stage each) and cannot deadlock (every micro-batch inside can always move on). Without
a bound, 2p: a micro-batch's way (2p forwards, 2p B's back, a tick a hop) takes 4p - 1 ticks
and one enters every second tick. Each stage then holds at most 3p - 1 chunk inputs, that is
1.5 p - 0.5 stage inputs (lockstep 1F1B's stage 0: 2p - 1), up to p of them past B with their
W put off: what the ramp-down fills its waits with.

The bubble: stage s runs nothing before tick s (ZB-V's start-up, p - 1 units on stage p - 1,
which the paper's count of zero leaves out), and from the first B (stage 0, tick 2p - 1)
until B's reach stage s, s ticks later, it runs a forward alone in ticks where another stage
runs a forward and a B: lockstep ticks cost their slowest stage. The table waits 2 (p - 1)
units in all, the rest of the step running three units a tick (F, B and W on every stage):
2 (p - 1) / (6 m + 2 (p - 1)), about (p - 1) / (3 m), against ZB-H1's table's p / (3 m + p)
in the same (stage) units and ZB-V's own (p - 1) / (6 m + p - 1).
`python -m mtnlg_jax.parallel.zero_bubble_v 4 8` prints a table and its bubble;
tests/test_zero_bubble_v.py.

The engine (tick_by_slot.py) runs B and W as for ZB-H1 with a switch over the two chunks, and moves
hand-offs both ways: activations s -> s + 1 for the first chunk and s -> s - 1 for the second
(the turn on stage p - 1 local), gradients the opposite ways (schedule.Schedule's back
columns).
"""

import collections
import functools
import sys

from mtnlg_jax.parallel import schedule, stage_order, zero_bubble

FORWARD, B, W = 0, 1, 2


@functools.lru_cache(maxsize=64)
def build(stages, micro_batches, max_in_flight=None):
    """The ZB-V table (schedule.Schedule, split, v_shape, two chunks a stage)."""
    p, m = zero_bubble.check_sizes(stages, micro_batches, max_in_flight)
    state = _State(p, m, max_in_flight or 2 * p)
    while state.weights_done < 2 * p * m:
        if len(state.rows) > 8 * p * (m + p):
            raise RuntimeError('schedule simulation made no progress')  # a bug, not bad input
        state.tick()
    return schedule._with_slots(
        p, 2, m, state.rows, state.act_ready, state.grad_ready, v_shape=True
    )


class _State:
    """The simulation: per stage, the forwards and B's whose input is here ({chunk: micro
    queue}), the W's put off (a queue of (micro, chunk)), the micro-batches in the pipeline
    and their W's still to run, the rows so far and when each chunk input and gradient
    arrived."""

    def __init__(self, p, m, bound):
        self.p, self.m, self.bound = p, m, bound
        self.last = 2 * p - 1
        self.ready = [[collections.defaultdict(collections.deque) for _ in range(p)] for _ in 'FB']
        self.pending_w = [collections.deque() for _ in range(p)]
        self.ready[FORWARD][0][0].extend(range(m))
        self.weights_left = {}  # micro in the pipeline -> its W's not yet run
        self.weights_done = 0
        self.rows, self.arriving = [], []
        self.act_ready, self.grad_ready = {(i, 0): 0 for i in range(m)}, {}

    def stage(self, chunk):
        return stage_order.stage_of(chunk, self.p, v_shape=True)

    def cost(self, kind, chunk):
        if chunk == self.last and kind != W:
            return 0 if kind == FORWARD else 2
        return 1

    def tick(self):
        """Append one tick's row [(forward, B, W) of each stage], each (micro, chunk) or None."""
        for kind, chunk, micro in self.arriving:  # what the last tick's hand-offs brought
            self.ready[kind][self.stage(chunk)][chunk].append(micro)
        self.arriving = []
        self.row = [[None, None, None] for _ in range(self.p)]
        self.used = [0] * self.p
        for s in range(self.p):
            if s == 0:  # the last chunk's forward makes its B ready
                self.run_first(s, FORWARD, lambda op: op[1] == self.last)
            self.run_first(s, B)
            self.run_first(s, FORWARD)
            if len(self.pending_w[s]) >= self.p:  # enough put off: the rest keep up
                self.run_first(s, W)
        top = max(max(self.used), 1)
        for s in range(self.p):
            for kind in (B, FORWARD, W) * 2:
                self.run_first(s, kind, room=top - self.used[s])
        self.rows.append([tuple(r) for r in self.row])

    def candidates(self, s, kind):
        """(micro, chunk) the stage may run as `kind` now, the preferred first."""
        if self.row[s][kind] is not None:
            return []
        if kind == W:
            return list(self.pending_w[s])[:1]
        ops = [(queue[0], chunk) for chunk, queue in self.ready[kind][s].items() if queue]
        if kind == FORWARD:  # a new micro-batch only within the bound
            full = len(self.weights_left) >= self.bound
            ops = [op for op in ops if op[1] != 0 or not full]
            return sorted(ops, key=lambda op: -op[1])
        return sorted(ops, key=lambda op: (op[0], -op[1]))

    def run_first(self, s, kind, allowed=lambda op: True, room=None):
        ops = [op for op in self.candidates(s, kind) if allowed(op)]
        if ops and (room is None or self.cost(kind, ops[0][1]) <= room):
            self.run(s, kind, *ops[0])

    def run(self, s, kind, micro, chunk):
        t = len(self.rows)
        if kind == W:
            self.pending_w[s].popleft()
            self.weights_done += 1
            self.weights_left[micro] -= 1
            if not self.weights_left[micro]:  # it leaves the pipeline at the tick's end
                del self.weights_left[micro]
        else:
            self.ready[kind][s][chunk].popleft()
        if kind == FORWARD:
            if chunk == 0:
                self.weights_left[micro] = 2 * self.p
            if chunk == self.last:  # the loss: its B may follow in this tick
                self.ready[B][s][chunk].append(micro)
                self.grad_ready[(micro, chunk)] = t
            else:
                self.arriving.append((FORWARD, chunk + 1, micro))
                self.act_ready[(micro, chunk + 1)] = t + 1
        elif kind == B:
            self.pending_w[s].append((micro, chunk))
            if chunk > 0:
                self.arriving.append((B, chunk - 1, micro))
                self.grad_ready[(micro, chunk - 1)] = t + 1
        self.row[s][kind] = (micro, chunk)
        self.used[s] += self.cost(kind, chunk)


def ideal_bubble(stages, micro_batches):
    """ZB-V's bubble with F = B = W, start-up included: the busiest stage's p - 1 units of
    it over its 6 m units of work."""
    p, m = stages, micro_batches
    return (p - 1) / (6 * m + p - 1)


def lockstep_bubble(stages, micro_batches):
    """The table's: start-up and the first B's way down, 2 (p - 1) units (module docstring)."""
    p, m = stages, micro_batches
    return 2 * (p - 1) / (6 * m + 2 * (p - 1))


if __name__ == '__main__':
    p, m = (int(a) for a in sys.argv[1:3])
    table = build(p, m)
    print(zero_bubble.diagram(table))
    bubble = table.bubble_fraction()
    print(f'ticks {table.ticks}, bubble {bubble:.3f} (2 (p - 1) units: '
          f'{lockstep_bubble(p, m):.3f}; ZB-V with its start-up {ideal_bubble(p, m):.3f}), '
          f'held {table.in_flight().max()} chunk inputs')  # fmt: skip
