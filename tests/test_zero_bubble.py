"""The ZB-H1 table (parallel/zero_bubble.py), on its own: no JAX."""

import numpy as np
import pytest

from mtnlg_jax.parallel import schedule, zero_bubble

IDLE = schedule.IDLE
SHAPES = [(2, 1), (2, 4), (3, 4), (4, 2), (4, 7), (4, 8), (4, 32), (8, 16), (35, 4)]


def _operations(table, kind):
    """{(micro, stage): tick} of every forward, B or W ('fwd', 'bwd', 'w'), each once."""
    done = {}
    for t, s in zip(*np.nonzero(getattr(table, f'{kind}_micro') != IDLE)):
        key = (int(getattr(table, f'{kind}_micro')[t, s]), int(s))
        assert key not in done, f'{kind} of {key} twice'
        assert getattr(table, f'{kind}_repeat')[t, s] == 0
        done[key] = int(t)
    return done


@pytest.mark.parametrize('p,m', SHAPES)
def test_every_forward_b_and_w_once_in_dependency_order(p, m):
    table = zero_bubble.build(p, m)
    fwd, b, w = (_operations(table, kind) for kind in ('fwd', 'bwd', 'w'))
    everything = {(i, s) for i in range(m) for s in range(p)}
    assert set(fwd) == set(b) == set(w) == everything
    for i, s in everything:
        if s > 0:  # the input arrives by the hand-off at the end of the previous tick
            assert fwd[(i, s)] >= fwd[(i, s - 1)] + 1
        if s < p - 1:
            assert b[(i, s)] >= b[(i, s + 1)] + 1 and b[(i, s)] > fwd[(i, s)]
        assert w[(i, s)] >= b[(i, s)] >= fwd[(i, s)]  # in a tick: F, B, W


@pytest.mark.parametrize('p,m', SHAPES)
def test_slots_hold_what_b_reads_until_b_and_its_taps_until_w(p, m):
    """Replay the table as the engine does (arrivals, forward, B, W): B must find its own
    micro-batch's residuals and output gradient (the last stage's B its input), W the taps
    its B wrote (parallel/taps.py)."""
    table = zero_bubble.build(p, m)
    stash = np.full((p, table.stash_slots), None, object)
    resids = np.full((p, table.resid_slots), None, object)
    grads = np.full((p, table.grad_slots), None, object)
    tapped = np.full((p, table.tap_slots), None, object)
    act_in, grad_in = [None] * p, [None] * p
    for t in range(table.ticks):
        sent_act, sent_grad = [None] * p, [None] * p
        for s in range(p):
            if table.recv_act_slot[t, s] != IDLE:
                stash[s, table.recv_act_slot[t, s]] = act_in[s]
            if table.recv_grad_slot[t, s] != IDLE:
                grads[s, table.recv_grad_slot[t, s]] = grad_in[s]
            if table.fwd_micro[t, s] != IDLE:
                key = (table.fwd_micro[t, s], s)
                if 0 < s < p - 1:
                    assert stash[s, table.fwd_slot[t, s]] == key
                if s < p - 1:
                    resids[s, table.fwd_resid_slot[t, s]] = key
                    sent_act[s + 1] = (key[0], s + 1)
            if table.bwd_micro[t, s] != IDLE:
                key = (table.bwd_micro[t, s], s)
                if s == p - 1 and s > 0:
                    assert stash[s, table.bwd_slot[t, s]] == key
                if s < p - 1:
                    assert resids[s, table.bwd_resid_slot[t, s]] == key
                    assert grads[s, table.bwd_grad_slot[t, s]] == key
                tapped[s, table.bwd_tap_slot[t, s]] = key
                if s > 0:
                    sent_grad[s - 1] = (key[0], s - 1)
            if table.w_micro[t, s] != IDLE:
                assert tapped[s, table.w_tap_slot[t, s]] == (table.w_micro[t, s], s)
        act_in, grad_in = sent_act, sent_grad
    assert max(table.resid_slots, table.tap_slots) <= table.in_flight().max()


@pytest.mark.parametrize('p,m', [(2, 4), (4, 4), (4, 8), (4, 32), (8, 16), (35, 240)])
def test_memory_of_1f1b(p, m):
    """A micro-batch stays on a stage from its forward to its W (residuals to B, taps from B
    to W), in 1F1B's memory: no more residual slots than its table's, no more micro-batches
    held on any stage."""
    zb, one = zero_bubble.build(p, m), schedule.build(p, 1, m)
    assert zb.resid_slots <= one.resid_slots
    assert zb.in_flight().max() <= one.in_flight().max()


@pytest.mark.parametrize('m', [4, 8, 16, 32, 64])
def test_bubble_at_p_4_is_zb_h1s(m):
    """ZB-H1's bubble is (p - 1) / (3 m) with F = B = W = 1 (Qi et al.). Counted from the
    table with lockstep ticks (a tick costs its slowest stage): within one unit of it (the
    stages wait p units, not p - 1), and under 1F1B's table with the same costs (7 units)."""
    p = 4
    table = zero_bubble.build(p, m)
    time, work = table.tick_costs()
    assert work.max() == 3 * m and time.sum() - work.max() == p
    assert abs(table.bubble_fraction() - (p - 1) / (3 * m)) <= 1 / (3 * m)
    one = schedule.build(p, 1, m)
    assert one.tick_costs()[0].sum() - 3 * m == 7
    assert table.bubble_fraction() < one.bubble_fraction()


@pytest.mark.parametrize('p,m,bound', [(4, 8, 2), (4, 16, 4), (8, 32, 3), (3, 5, 1)])
def test_max_in_flight_bounds_what_each_stage_holds(p, m, bound):
    """pipeline.max_in_flight: at most `bound` micro-batches between forward and W a stage
    (residual and tap slots), paid for with idle ticks; every operation still runs once."""
    capped, free = zero_bubble.build(p, m, bound), zero_bubble.build(p, m)
    assert capped.in_flight().max() <= bound < free.in_flight().max()
    assert max(capped.resid_slots, capped.tap_slots) <= bound and capped.ticks > free.ticks
    assert (capped.w_micro != IDLE).sum() == p * m


def test_diagram_shows_each_slot():
    text = zero_bubble.diagram(zero_bubble.build(3, 4))
    assert text.splitlines()[1].split()[:3] == ['stage', '0', 'F0']
    assert 'F0B0' in text.splitlines()[3] and 'W3' in text


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match='must be >= 1'):
        zero_bubble.build(2, 0)
    with pytest.raises(ValueError, match='max_in_flight'):
        zero_bubble.build(2, 4, max_in_flight=0)
