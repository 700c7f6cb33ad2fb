"""The static pipeline schedule: for every tick and stage, which forward and which backward.

p stages, v chunks per stage (pipeline.repeats), m micro-batches. The block stack is cut into
p v chunks; chunk c runs on stage c mod p. A tick has one forward slot and one backward slot
on every stage (each may be idle); at its end activations move one stage forward and
gradients one stage back (`ppermute`, the last stage's output going round to stage 0 for the
next chunk when v > 1). The table is built here in numpy by simulating the ticks greedily:
each slot takes the ready operation of smallest priority, Megatron's order:

    forward  (i // p, repeat, i mod p)            groups of p micro-batches, chunk by chunk
    backward (i // p, v - 1 - repeat, i mod p)    the same groups, chunks in reverse

With v = 1 this is 1F1B (PipeDream-flush), with v > 1 Megatron's interleaved 1F1B. p = 3,
v = 1, m = 4 (F3 = forward of micro-batch 3; ticks hold F then B):

    tick       0    1    2      3      4      5      6    7
    stage 0   F0   F1   F2     F3     B0     B1     B2   B3
    stage 1        F0   F1   F2 B0  F3 B1    B2     B3
    stage 2             F0 B0  F1 B1  F2 B2  F3 B3

Ramp-up ticks hold only forwards, ramp-down ticks only backwards: a tick costs its slowest
stage, so the step takes (m + p - 1) (F + B) when v = 1, the 1F1B bubble (p - 1) / (m + p - 1)
(`bubble_fraction` computes it from the table for any v). The last chunk's forward is empty:
its backward's tick runs it with the head and the loss, so F and B of a micro-batch share the
last stage's tick. Every other forward keeps what its chunk's backward needs (the residuals
of its VJP under model.remat) until that backward: stage s holds at most 2 (p - s) - 1
micro-batches in flight with v = 1, whatever m (Megatron's asynchronous 1F1B holds p - s; in
lockstep ticks a micro-batch waits a whole tick per hop both ways). `max_in_flight` caps it
at the cost of idle ticks: with v = 1 stage s holds at most that many inputs; with v > 1 a
stage holds at most max_in_flight v chunk inputs, the memory of max_in_flight micro-batches.
Up to p it counts the micro-batches in the pipeline (one enters with its chunk 0 on stage 0
and leaves when that chunk's backward ends). Above p it counts stage 0's chunk inputs (stage
0 holds the most: its chunk 0 waits the longest): a micro-batch enters while stage 0 holds
fewer than max_in_flight v, the unbounded table with entries held back until stage 0's
backwards free room, each chunk input held less costing about an F + B of stage 0; counting
micro-batches there lets the next ones in piecemeal, and their holes cost a whole F + B in
every tick of the steady state (docs/benchmarks.md, "The in-flight bound against the
bubble"). Below p v stage 0's count cannot hold (the first p micro-batches bring all their
chunks to stage 0 before its first backward), hence the micro-batch count up to p; a table
over its budget above p (none found, p < 9, v < 6) falls back to it too. Bounding each
stage's chunk inputs could deadlock (a stage full of chunks whose backwards wait for forwards
another stage cannot take); bounding only entry cannot: every micro-batch inside can always
move on.

Slots: an arriving activation is written into a free stash slot (`recv_act_slot`) and stays
until its forward reads it (the last chunk's: until its backward); a forward's residuals go
into a free residual slot (`fwd_resid_slot`) until its backward; an arriving gradient into a
free gradient slot until its backward.
"""

import dataclasses
import functools
import heapq

import numpy as np

from mtnlg_jax.parallel import stage_order

IDLE = -1
# The per-(tick, stage) arrays of a Schedule, in the engine's order.
COLUMNS = (
    'fwd_micro',
    'fwd_repeat',
    'fwd_slot',
    'fwd_resid_slot',
    'bwd_micro',
    'bwd_repeat',
    'bwd_slot',
    'bwd_resid_slot',
    'bwd_grad_slot',
    'recv_act_slot',
    'recv_grad_slot',
)
# ... those of a split backward's W slot (Schedule.split)
W_COLUMNS = ('w_micro', 'w_repeat', 'w_tap_slot', 'bwd_tap_slot')
# ... and the V placement's way back (Schedule.v_shape)
BACK_COLUMNS = ('recv_act_back_slot', 'recv_grad_back_slot')


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Arrays (ticks, stages) of int32, IDLE (-1) where a slot holds nothing.

    fwd_micro, fwd_repeat: the forward of micro-batch fwd_micro through the stage's chunk
        fwd_repeat (global chunk fwd_repeat p + stage); fwd_slot: stash slot of its input
        (IDLE for chunk 0: the embedding); fwd_resid_slot: the residual slot its forward
        writes what the chunk's backward needs into (IDLE for the last chunk, whose forward
        runs in its backward's tick).
    bwd_micro, bwd_repeat: the same for the backward; bwd_resid_slot: the residual slot it
        reads; bwd_slot: the stash slot of the last chunk's input (IDLE for other chunks);
        bwd_grad_slot: gradient slot of its output's gradient (IDLE for the last chunk: the
        loss).
    recv_act_slot / recv_grad_slot: where the activation / gradient that arrives at the start
        of the tick goes (IDLE: nothing arrives, or nothing needs it).

    A stage input stays in its stash slot from its arrival to its forward (the last chunk's:
    to its backward); the residuals of a forward from that tick to its backward; a gradient
    from its arrival to its backward.
    """

    stages: int
    repeats: int
    micro_batches: int
    fwd_micro: np.ndarray
    fwd_repeat: np.ndarray
    fwd_slot: np.ndarray
    fwd_resid_slot: np.ndarray
    bwd_micro: np.ndarray
    bwd_repeat: np.ndarray
    bwd_slot: np.ndarray
    bwd_resid_slot: np.ndarray
    bwd_grad_slot: np.ndarray
    recv_act_slot: np.ndarray
    recv_grad_slot: np.ndarray
    stash_slots: int
    resid_slots: int
    grad_slots: int
    # A split backward (zero_bubble.py): B above runs the backward but for the kernels'
    # weight gradients, W those from the taps B kept (parallel/taps.py), in a slot of its
    # own; these columns (None where the backward is whole): w_micro, w_repeat as for B;
    # bwd_tap_slot: the tap slot B writes, w_tap_slot: the one W reads. What B reads is
    # held until B, the taps from B to W.
    w_micro: np.ndarray = None
    w_repeat: np.ndarray = None
    w_tap_slot: np.ndarray = None
    bwd_tap_slot: np.ndarray = None
    tap_slots: int = 0
    # The V placement (zero_bubble_v.py): stage s holds chunks s and 2p - 1 - s
    # (stage_order.chunk_index), so the second chunk's hand-offs run the other way: its input
    # arrives from stage s + 1 (on stage p - 1 from its own first chunk, the turn) into
    # recv_act_back_slot, its output's gradient from stage s - 1 into recv_grad_back_slot;
    # the first chunk's gradient on stage p - 1 comes from its own second chunk (the turn).
    v_shape: bool = False
    recv_act_back_slot: np.ndarray = None
    recv_grad_back_slot: np.ndarray = None

    @property
    def ticks(self):
        return self.fwd_micro.shape[0]

    @property
    def split(self):
        """Whether the backward is split into B (input gradient) and W (weight gradients)."""
        return self.w_micro is not None

    def in_flight(self):
        """(ticks, stages): micro-batches forwarded through the stage and not yet
        back-propagated, counted between the tick's forward and its backward (its peak)."""
        held = np.zeros((self.ticks, self.stages), np.int64)
        released = self.released()
        for s in range(self.stages):
            count = 0
            for t in range(self.ticks):
                count += int(self.fwd_micro[t, s] != IDLE)
                held[t, s] = count
                count -= int(released[t, s] != IDLE)
        return held

    @property
    def last_stage(self):
        """The stage of the last chunk (the head and the loss): p - 1, or 0 in the V."""
        return 0 if self.v_shape else self.stages - 1

    def released(self):
        """The micro column of the slot that ends a micro-batch's stay: W where split, else B."""
        return self.w_micro if self.split else self.bwd_micro

    def tick_costs(self, forward=1.0, backward=2.0):
        """(each tick's cost, its slowest stage's work; each stage's work): a backward about 2
        forwards (3 with full recompute); where split, W a forward's matmuls again (dW =
        x^T dy) and B the rest; the last chunk's forward empty (its backward's tick runs it)."""
        last = self.fwd_repeat == self.repeats - 1
        last &= np.arange(self.stages)[None, :] == self.last_stage
        work = forward * ((self.fwd_micro != IDLE) & ~last)
        if self.split:
            work = work + (backward - forward) * (self.bwd_micro != IDLE)
            work = work + forward * (self.w_micro != IDLE)
        else:
            work = work + backward * (self.bwd_micro != IDLE)
        return work.max(axis=1), work.sum(axis=0)

    def bubble_fraction(self, forward=1.0, backward=2.0):
        """Share of the step the busiest stage spends waiting: 1 - its work / the step time
        (the last stage's lighter work, its last chunk's forward folded into the backward,
        is imbalance, not bubble)."""
        time, work = self.tick_costs(forward, backward)
        return 1.0 - work.max() / time.sum()


def _priority(micro, repeat, stages, repeats, backward):
    chunk_order = repeats - 1 - repeat if backward else repeat
    return (micro // stages, chunk_order, micro % stages)


@functools.lru_cache(maxsize=64)  # the train loop asks for the same few tables every step
def build(stages, repeats, micro_batches, max_in_flight=None):
    """The greedy 1F1B (repeats 1) or interleaved 1F1B (repeats > 1) table; see the module
    docstring. max_in_flight: at most this many stage inputs held per stage (v = 1), or this
    many micro-batches' chunk inputs (v of each) per stage (v > 1); None: as many as the
    greedy order needs."""
    p, v, m = stages, repeats, micro_batches
    if min(p, v, m) < 1:
        raise ValueError(f'stages, repeats, micro_batches must be >= 1, got {p}, {v}, {m}')
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f'max_in_flight must be >= 1, got {max_in_flight}')
    if max_in_flight is None or v == 1 or max_in_flight <= p:
        return _greedy(p, v, m, max_in_flight)
    table = _greedy(p, v, m, max_in_flight, budget=max_in_flight * v)
    if table.in_flight().max() <= max_in_flight * v:
        return table
    return _greedy(p, v, m, max_in_flight)


def _greedy(p, v, m, max_in_flight, budget=None):
    """Simulate the ticks (build's docstring). budget: with v > 1, admit a micro-batch while
    stage 0 holds fewer chunk inputs (else: while fewer than max_in_flight micro-batches are in
    the pipeline)."""
    last = p * v - 1
    act_ready = {(i, 0): 0 for i in range(m)}  # (micro, chunk) -> first tick its input is here
    grad_ready = {}
    # Per stage, heaps of (priority, key) of the operations whose input (gradient) is here.
    forwards = [[] for _ in range(p)]
    backwards = [[] for _ in range(p)]
    for i in range(m):
        heapq.heappush(forwards[0], (_priority(i, 0, p, v, False), (i, 0)))
    arriving = []  # (heaps, priority, key) that become ready next tick
    rows, held, done, t = [], [0] * p, 0, 0
    entered = 0  # v > 1: micro-batches whose chunk 0 ran forward and not yet backward

    def admitted(s, key):
        if max_in_flight is None:
            return True
        if v == 1:
            return held[s] < max_in_flight
        if budget is not None:
            return key[1] != 0 or held[0] < budget
        return key[1] != 0 or entered < max_in_flight

    while done < m * p * v:
        if t > 4 * (m * p * v + p * v):
            raise RuntimeError('schedule simulation made no progress')  # a bug, not bad input
        for heap, priority, key in arriving:
            heapq.heappush(heap, (priority, key))
        arriving = []
        row = []
        for s in range(p):
            fwd = bwd = None
            fwd = _pop_first(forwards[s], lambda key: admitted(s, key))
            if fwd is not None:
                held[s] += 1
                entered += fwd[1] == 0
                if fwd[1] == last:  # the loss: its backward may follow in this tick
                    grad_ready[fwd] = t
                    priority = _priority(fwd[0], fwd[1] // p, p, v, True)
                    heapq.heappush(backwards[s], (priority, fwd))
                else:
                    nxt = (fwd[0], fwd[1] + 1)
                    act_ready[nxt] = t + 1
                    priority = _priority(nxt[0], nxt[1] // p, p, v, False)
                    arriving.append((forwards[nxt[1] % p], priority, nxt))
            if backwards[s]:
                bwd = heapq.heappop(backwards[s])[1]
                held[s] -= 1
                entered -= bwd[1] == 0
                done += 1
                if bwd[1] > 0:
                    prev = (bwd[0], bwd[1] - 1)
                    grad_ready[prev] = t + 1
                    priority = _priority(prev[0], prev[1] // p, p, v, True)
                    arriving.append((backwards[prev[1] % p], priority, prev))
            row.append((fwd, bwd))
        rows.append(row)
        t += 1
    return _with_slots(p, v, m, rows, act_ready, grad_ready)


def _pop_first(heap, allowed):
    """The key of the heap's first (priority, key) that allowed(key) takes, popped; or None."""
    skipped, found = [], None
    while heap and found is None:
        item = heapq.heappop(heap)
        if allowed(item[1]):
            found = item[1]
        else:
            skipped.append(item)
    for item in skipped:
        heapq.heappush(heap, item)
    return found


def _with_slots(p, v, m, rows, act_ready, grad_ready, v_shape=False):
    """Fill the table's arrays and give every stashed input and pending gradient a slot: the
    lowest one free from its arrival to the backward that reads it, and where a row holds
    (forward, B, W) per stage (zero_bubble.py's split tables) B's taps one from B to W.
    v_shape: chunks placed in a V (zero_bubble_v.py), the second chunk's arrivals in the
    BACK_COLUMNS."""
    ticks = len(rows)
    shape = (ticks, p)
    split = len(rows[0][0]) == 3
    names = COLUMNS + (W_COLUMNS if split else ()) + (BACK_COLUMNS if v_shape else ())
    arrays = {name: np.full(shape, IDLE, np.int32) for name in names}
    at = [{op[k]: t for t, row in enumerate(rows) for op in row if op[k] is not None}
          for k in range(len(rows[0][0]))]  # fmt: skip
    fwd_at, end_at = at[0], at[1]
    last = p * v - 1

    def stage(key):
        return stage_order.stage_of(key[1], p, v_shape)

    def assign(start, end, skip, recv=None):
        """Slots for every key of `start` (first tick held) but `skip`'s, each held to its
        `end` tick; returns ({key: slot}, slot count). recv: the arrival column, and where
        the V's second chunk arrives, that of the way back."""
        slot_of, free_at = {}, [[] for _ in range(p)]  # free_at[s][k]: first tick slot k free
        for key in sorted(start, key=lambda k: start[k]):
            if skip(key):
                continue
            s, first = stage(key), start[key]
            k = next((k for k, free in enumerate(free_at[s]) if free <= first), None)
            if k is None:
                k = len(free_at[s])
                free_at[s].append(0)
            free_at[s][k] = end[key] + 1
            slot_of[key] = k
            if recv:
                back = v_shape and key[1] >= p
                arrays[recv.replace('_slot', '_back_slot') if back else recv][first, s] = k
        return slot_of, max((len(f) for f in free_at), default=0)

    # a stage input is read by its forward (the last chunk's by its backward, which runs it)
    read_at = {key: (end_at if key[1] == last else fwd_at)[key] for key in act_ready}
    stash, stash_slots = assign(act_ready, read_at, lambda k: k[1] == 0, 'recv_act_slot')
    resid, resid_slots = assign(fwd_at, end_at, lambda k: k[1] == last)
    grads, grad_slots = assign(grad_ready, end_at, lambda k: k[1] == last, 'recv_grad_slot')
    tapped, tap_slots = assign(end_at, at[-1], lambda k: False) if split else ({}, 0)
    for t, row in enumerate(rows):
        for s, (fwd, bwd, *w) in enumerate(row):
            if fwd is not None:
                arrays['fwd_micro'][t, s], arrays['fwd_repeat'][t, s] = fwd[0], fwd[1] // p
                arrays['fwd_slot'][t, s] = stash.get(fwd, IDLE) if fwd[1] != last else IDLE
                arrays['fwd_resid_slot'][t, s] = resid.get(fwd, IDLE)
            if bwd is not None:
                arrays['bwd_micro'][t, s], arrays['bwd_repeat'][t, s] = bwd[0], bwd[1] // p
                arrays['bwd_slot'][t, s] = stash.get(bwd, IDLE) if bwd[1] == last else IDLE
                arrays['bwd_resid_slot'][t, s] = resid.get(bwd, IDLE)
                arrays['bwd_grad_slot'][t, s] = grads.get(bwd, IDLE)
                if split:
                    arrays['bwd_tap_slot'][t, s] = tapped[bwd]
            if w and w[0] is not None:
                arrays['w_micro'][t, s], arrays['w_repeat'][t, s] = w[0][0], w[0][1] // p
                arrays['w_tap_slot'][t, s] = tapped[w[0]]
    if split:
        arrays['tap_slots'] = max(tap_slots, 1)
    return Schedule(
        stages=p,
        repeats=v,
        micro_batches=m,
        v_shape=v_shape,
        stash_slots=max(stash_slots, 1),
        resid_slots=max(resid_slots, 1),
        grad_slots=max(grad_slots, 1),
        **arrays,
    )
