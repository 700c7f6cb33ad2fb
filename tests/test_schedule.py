"""The static pipeline table (parallel/schedule.py), on its own: no JAX."""

import numpy as np
import pytest

from mtnlg_jax.parallel import schedule

IDLE = schedule.IDLE
# (p, v, m): 1F1B, interleaved, m < p, m not a multiple of p, MT-NLG's ramp start and full.
SHAPES = [(2, 1, 2), (3, 1, 4), (4, 1, 2), (4, 1, 7), (2, 2, 4), (4, 2, 8), (4, 2, 3), (3, 3, 5)]
SHAPES += [(35, 1, 4), (35, 1, 240)]
# ... and interleaved bounded above p, by stage 0's chunk inputs: (p, v, m, max_in_flight)
SHAPES += [(4, 2, 16, 5), (8, 2, 19, 9), (16, 4, 32, 17)]


def _table(shape):
    p, v, m, *bound = shape
    return schedule.build(p, v, m, *bound)


def _name(shape):
    return '-'.join(map(str, shape))


def _operations(table, kind):
    """{(micro, chunk): tick} of every forward ('fwd') or backward ('bwd'); fails on repeats."""
    micro, repeat = getattr(table, f'{kind}_micro'), getattr(table, f'{kind}_repeat')
    done = {}
    for t, s in zip(*np.nonzero(micro != IDLE)):
        key = (int(micro[t, s]), int(repeat[t, s]) * table.stages + int(s))
        assert key not in done, f'{kind} of {key} twice'
        done[key] = int(t)
    return done


@pytest.mark.parametrize('shape', SHAPES, ids=_name)
def test_every_forward_and_backward_once_in_dependency_order(shape):
    table = _table(shape)
    p, v, m = shape[:3]
    fwd, bwd = _operations(table, 'fwd'), _operations(table, 'bwd')
    everything = {(i, c) for i in range(m) for c in range(p * v)}
    assert set(fwd) == everything and set(bwd) == everything
    last = p * v - 1
    for i, c in everything:
        if c > 0:  # the input arrives by the hand-off at the end of the previous tick
            assert fwd[(i, c)] >= fwd[(i, c - 1)] + 1
        if c < last:
            assert bwd[(i, c)] >= bwd[(i, c + 1)] + 1
        assert bwd[(i, c)] >= fwd[(i, c)]  # the last chunk's may share the tick (F first)


@pytest.mark.parametrize('shape', SHAPES, ids=_name)
def test_slots_hold_each_input_residual_and_gradient_until_it_is_read(shape):
    """Replay the table as the engine does: arrivals are written into slots, a forward reads
    its input (the last chunk's backward: its input) and writes its residuals, a backward
    reads its residuals and gradient; every read must find its own (micro-batch, chunk)."""
    table = _table(shape)
    p, v = shape[:2]
    stash = np.full((p, table.stash_slots), None, object)
    resids = np.full((p, table.resid_slots), None, object)
    grads = np.full((p, table.grad_slots), None, object)
    act_in, grad_in = [None] * p, [None] * p
    last = p * v - 1
    for t in range(table.ticks):
        sent_act, sent_grad = [None] * p, [None] * p
        for s in range(p):
            if table.recv_act_slot[t, s] != IDLE:
                stash[s, table.recv_act_slot[t, s]] = act_in[s]
            if table.recv_grad_slot[t, s] != IDLE:
                grads[s, table.recv_grad_slot[t, s]] = grad_in[s]
            if table.fwd_micro[t, s] != IDLE:
                key = (table.fwd_micro[t, s], table.fwd_repeat[t, s] * p + s)
                if 0 < key[1] < last:
                    assert stash[s, table.fwd_slot[t, s]] == key
                if key[1] < last:
                    resids[s, table.fwd_resid_slot[t, s]] = key
                    sent_act[(s + 1) % p] = (key[0], key[1] + 1)
                else:
                    assert table.fwd_resid_slot[t, s] == IDLE
            if table.bwd_micro[t, s] != IDLE:
                key = (table.bwd_micro[t, s], table.bwd_repeat[t, s] * p + s)
                if key[1] == last and key[1] > 0:
                    assert stash[s, table.bwd_slot[t, s]] == key
                if key[1] < last:
                    assert resids[s, table.bwd_resid_slot[t, s]] == key
                    assert grads[s, table.bwd_grad_slot[t, s]] == key
                if key[1] > 0:
                    sent_grad[(s - 1) % p] = (key[0], key[1] - 1)
        act_in, grad_in = sent_act, sent_grad
    # a residual slot per micro-batch in flight on the busiest stage, no more
    assert table.resid_slots == table.in_flight().max()


@pytest.mark.parametrize('p,m', [(2, 2), (3, 4), (4, 2), (4, 7), (35, 4), (35, 240)])
def test_1f1b_holds_at_most_2_p_minus_s_minus_1_inputs_in_m_plus_2p_minus_2_ticks(p, m):
    table = schedule.build(p, 1, m)
    assert table.ticks == m + 2 * p - 2
    held = table.in_flight().max(axis=0)
    bound = 2 * (p - np.arange(p)) - 1
    assert (held <= np.minimum(bound, m)).all()
    assert table.stash_slots <= 2 * p - 3 and table.grad_slots == 1  # stage 0 stashes nothing


@pytest.mark.parametrize('p,m', [(3, 4), (4, 9), (35, 240)])
def test_capped_1f1b_holds_at_most_p_minus_s_inputs(p, m):
    """Megatron's asynchronous bound, bought with idle ticks."""
    capped = schedule.build(p, 1, m, max_in_flight=p)
    assert capped.in_flight().max() <= p
    assert capped.ticks > schedule.build(p, 1, m).ticks


@pytest.mark.parametrize(
    'p,v,m,bound', [(4, 2, 8, 2), (4, 2, 16, 4), (16, 4, 32, 12), (3, 3, 5, 1)]
)
def test_bounded_interleaved_holds_at_most_the_bound_times_v_chunk_inputs(p, v, m, bound):
    """At most `bound` micro-batches in the pipeline, each with at most v chunk inputs a
    stage: every operation runs once, with idle ticks for it."""
    capped, free = schedule.build(p, v, m, max_in_flight=bound), schedule.build(p, v, m)
    assert capped.in_flight().max() <= bound * v < free.in_flight().max()
    assert (capped.fwd_micro != schedule.IDLE).sum() == (free.fwd_micro != schedule.IDLE).sum()
    assert (capped.bwd_micro != schedule.IDLE).sum() == p * v * m
    assert capped.ticks > free.ticks


@pytest.mark.parametrize(
    'p,v,m,bound', [(4, 2, 16, 5), (6, 3, 18, 7), (8, 2, 19, 9), (16, 4, 32, 17), (16, 4, 32, 19)]
)
def test_interleaved_bounded_above_p_by_stage_0s_chunk_inputs(p, v, m, bound):
    """Above p micro-batches the bound is the memory, bound v chunk inputs a stage: a
    micro-batch enters while stage 0 holds fewer. Each bound is faster than the one below it
    (down to p) and than counting micro-batches, whose early entries leave holes in the steady
    state (p 16, v 4, m 32: 0.357 at 20 against 0.183 at 16)."""
    capped, free = schedule.build(p, v, m, bound), schedule.build(p, v, m)
    assert capped.in_flight().max() <= bound * v < free.in_flight().max()
    assert capped.bubble_fraction() < schedule.build(p, v, m, bound - 1).bubble_fraction()
    counted = schedule._greedy(p, v, m, bound)  # the micro-batches counted, as up to p
    assert capped.bubble_fraction() < counted.bubble_fraction()
    assert capped.ticks < counted.ticks


def test_a_bound_above_the_natural_count_is_the_unbounded_table():
    """p 16, v 4, m 32 holds 79 chunk inputs unbounded: a bound of 20 micro-batches (80) is no
    bound, and the 405B's 17 (68) pays an F + B per chunk input held less."""
    free = schedule.build(16, 4, 32)
    assert np.array_equal(schedule.build(16, 4, 32, 20).fwd_micro, free.fwd_micro)
    time, _ = free.tick_costs()
    for bound, held in ((17, 68), (18, 72)):
        table = schedule.build(16, 4, 32, bound)
        assert table.in_flight().max() == held
        assert table.tick_costs()[0].sum() == time.sum() + 3 * (79 - held)


@pytest.mark.parametrize('p,v,m', [(2, 2, 4), (4, 2, 8), (4, 2, 16), (4, 4, 32), (3, 3, 5)])
def test_interleaved_holds_at_most_megatrons_warmup_plus_one(p, v, m):
    """Megatron's interleaved 1F1B starts (p - s - 1) 2 + (v - 1) p forwards before its first
    backward: at most that + 1 inputs per stage, whatever m."""
    held = schedule.build(p, v, m).in_flight().max(axis=0)
    stage = np.arange(p)
    assert (held <= np.minimum((p - stage - 1) * 2 + (v - 1) * p + 1, v * m)).all()


@pytest.mark.parametrize('p,v,m', [(4, 1, 8), (4, 1, 32), (4, 2, 8), (4, 2, 32), (8, 4, 64)])
def test_bubble_near_megatrons(p, v, m):
    """Lockstep ticks keep the 1F1B / interleaved bubble (p - 1) / (v m + p - 1), give or
    take the last stage's lighter work (its last chunk's forward is folded into the
    backward)."""
    table = schedule.build(p, v, m)
    predicted = (p - 1) / (v * m + p - 1)
    assert abs(table.bubble_fraction() - predicted) < 0.05
    # No slower than Megatron's 1F1B, (m + p - 1) (F + B), with F = 1, B = 3.
    if v == 1:
        time, _ = table.tick_costs(forward=1, backward=3)
        assert time.sum() <= (m + p - 1) * 4


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match='must be >= 1'):
        schedule.build(2, 1, 0)
    with pytest.raises(ValueError, match='max_in_flight'):
        schedule.build(2, 2, 4, max_in_flight=0)
