"""The ZB-H1 table (Qi et al. 2024, arXiv 2401.10241): 1F1B with each backward split in two.

B, the gradient of a chunk's input, is on the critical path: it runs as soon as its gradient
arrives. W, the gradient of the chunk's weights, waits: in 1F1B's ramp-down stages stand idle
until the last micro-batch's gradient comes back, and there the W's put off before fill the
wait. A tick holds a forward, a B and a W slot on every stage (each may be idle); costs count
a forward 1, B 1, W 1 (the last chunk's forward 0: its B's tick runs it, with the head and
the loss, so the last stage's B costs 2). Built greedily, tick by tick, one stage at a time:

    first  B if a gradient is here (the last stage: its forward first, then its B)
           else W if more than p - 1 - s are put off on stage s, or a forward waits on the
           memory bound; else a forward if the bound allows; else W
    then   more of the same while the stage's work stays within the tick's slowest stage's

Memory: a micro-batch stays on a stage from its forward to its W (its residuals and its
output's gradient until B, B's taps from B to W), at most 1F1B's peak (its table's busiest
stage) or `max_in_flight`. p = 3, m = 4 (F3 = forward of micro-batch 3; a tick runs F, then
B, then W):

    tick     0    1    2    3    4    5    6    7    8    9
    stage 0  F0   F1   F2   F3   B0W0 B1W1 B2   B3   W2   W3
    stage 1       F0   F1   F2B0 F3B1 B2W0 B3   W1   W2   W3
    stage 2            F0B0 F1B1 F2B2 F3B3 W0   W1   W2   W3

Ticks 6 and 7 cost one unit, not 1F1B's two: B's alone run back to stage 0, W's after.
At p = 4 the stages wait p units a step (ZB-H1: p - 1; 1F1B's table: 7), so the bubble is
p / (3 m + p), about (p - 1) / (3 m) (`python -m mtnlg_jax.parallel.zero_bubble 4 8` prints a
table and its bubble; tests/test_zero_bubble.py).

The engine (backward_slot.py) runs B as the chunk's whole VJP (the last chunk's forward, head and
loss first) but for its kernels' weight gradients: every kernel matmul is tapped
(parallel/taps.py), so B hands out each one's input x and output gradient dy, kept in a tap
slot until W; the norms', biases' and shared parameters' gradients (elementwise reductions,
and the head's) are B's. W is only the kernels' dW = x^T dy, one contraction per matmul: the
step's matmul FLOPs are 1F1B's (tests/test_pipeline_flops.py).
"""

import collections
import functools
import sys

from mtnlg_jax.parallel import schedule


@functools.lru_cache(maxsize=64)
def build(stages, micro_batches, max_in_flight=None):
    """The ZB-H1 table (schedule.Schedule with W columns) of one chunk a stage."""
    p, m = check_sizes(stages, micro_batches, max_in_flight)
    bound = max_in_flight or int(schedule.build(p, 1, m).in_flight().max())
    state = _State(p, m, bound)
    while state.weights_done < p * m:
        if len(state.rows) > 4 * p * (m + p):
            raise RuntimeError('schedule simulation made no progress')  # a bug, not bad input
        state.tick()
    return schedule._with_slots(p, 1, m, state.rows, state.act_ready, state.grad_ready)


def check_sizes(stages, micro_batches, max_in_flight):
    """(stages, micro_batches) of a zero-bubble table, each >= 1 as the bound is (ValueError)."""
    if min(stages, micro_batches) < 1:
        raise ValueError(f'stages, micro_batches must be >= 1, got {stages}, {micro_batches}')
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f'max_in_flight must be >= 1, got {max_in_flight}')
    return stages, micro_batches


class _State:
    """The simulation: per stage, queues of the forwards and B's whose input is here and of
    the W's put off, the micro-batches held (forward done, W not), the rows so far and when
    each stage input and gradient arrived."""

    def __init__(self, p, m, bound):
        self.p, self.bound = p, bound
        self.queues = {kind: [collections.deque() for _ in range(p)] for kind in 'FBW'}
        self.queues['F'][0].extend(range(m))
        self.held, self.forwards_done, self.weights_done = [0] * p, [0] * p, 0
        self.micro_batches = m
        self.rows, self.arriving = [], []
        self.act_ready, self.grad_ready = {(i, 0): 0 for i in range(m)}, {}

    def cost(self, s, kind):
        last = s == self.p - 1
        return {'F': 0 if last else 1, 'B': 2 if last else 1, 'W': 1}[kind]

    def tick(self):
        """Append one tick's row [(forward, B, W) of each stage], each (micro, chunk) or None."""
        for kind, s, micro in self.arriving:  # what the last tick's hand-offs brought
            self.queues[kind][s].append(micro)
        self.arriving = []
        self.row = [[None, None, None] for _ in range(self.p)]
        self.used = [0] * self.p
        for s in range(self.p):
            for kind in self.first_choice(s):
                if self.ready(s, kind):
                    self.run(s, kind)
        top = max(max(self.used), 1)
        for s in range(self.p):
            for kind in 'BFW' * 2:
                if self.ready(s, kind) and self.used[s] + self.cost(s, kind) <= top:
                    self.run(s, kind)
            if self.must_weigh(s):
                self.run(s, 'W')
        self.rows.append([tuple(r) for r in self.row])
        self.held = [h - (r[2] is not None) for h, r in zip(self.held, self.row)]

    def ready(self, s, kind):
        if self.row[s]['FBW'.index(kind)] is not None or not self.queues[kind][s]:
            return False
        return kind != 'F' or self.held[s] < self.bound

    def first_choice(self, s):
        """What stage s runs first: B if its gradient is here (the last stage: its forward,
        empty, before it), else a forward if the bound allows, else W."""
        if s == self.p - 1:  # its forward makes its B ready
            kinds = ['F', 'B'] if self.ready(s, 'F') else ['B']
        else:  # B first: the critical path
            kinds = [kind for kind in 'BF' if self.ready(s, kind)][:1]
        return kinds + ['W', 'F'] if not kinds or self.must_weigh(s) else kinds

    def must_weigh(self, s):
        """Whether the micro-batches held reach the bound while forwards are still to come:
        without a W in this tick, next tick's forward would wait."""
        coming = self.forwards_done[s] < self.micro_batches
        return coming and self.held[s] >= self.bound and self.ready(s, 'W')

    def run(self, s, kind):
        p, t = self.p, len(self.rows)
        micro = self.queues[kind][s].popleft()
        if kind == 'F':
            self.held[s] += 1
            self.forwards_done[s] += 1
            if s == p - 1:  # the loss: its B may follow in this tick
                self.queues['B'][s].append(micro)
                self.grad_ready[(micro, s)] = t
            else:
                self.arriving.append(('F', s + 1, micro))
                self.act_ready[(micro, s + 1)] = t + 1
        elif kind == 'B':
            self.queues['W'][s].append(micro)
            if s > 0:
                self.arriving.append(('B', s - 1, micro))
                self.grad_ready[(micro, s - 1)] = t + 1
        else:  # what it held is free at the tick's end (held, in tick)
            self.weights_done += 1
        self.row[s]['FBW'.index(kind)] = (micro, s)
        self.used[s] += self.cost(s, kind)


def diagram(table):
    """The table as text: a line per stage, a column per tick of its F, B and W (lower case
    f, b, w: the stage's second chunk, two chunks a stage)."""
    cells = []
    columns = [(table.fwd_micro, table.fwd_repeat), (table.bwd_micro, table.bwd_repeat)]
    columns.append((table.w_micro, table.w_repeat))
    for s in range(table.stages):
        line = []
        for t in range(table.ticks):
            ops = [
                (kind.lower() if repeat[t, s] else kind) + str(micro[t, s])
                for kind, (micro, repeat) in zip('FBW', columns)
                if micro[t, s] != schedule.IDLE
            ]
            line.append(''.join(ops))
        cells.append(line)
    width = max(len(c) for line in cells for c in line) + 1
    header = ['tick'.ljust(9)] + [str(t).ljust(width) for t in range(table.ticks)]
    lines = [''.join(header)]
    lines += [
        f'stage {s}'.ljust(9) + ''.join(c.ljust(width) for c in cells[s])
        for s in range(table.stages)
    ]
    return '\n'.join(line.rstrip() for line in lines)


if __name__ == '__main__':
    p, m = (int(a) for a in sys.argv[1:3])
    table = build(p, m)
    print(diagram(table))
    bubble, formula = table.bubble_fraction(), (p - 1) / (3 * m)
    print(f'ticks {table.ticks}, bubble {bubble:.3f}, (p - 1) / (3 m) {formula:.3f}')
