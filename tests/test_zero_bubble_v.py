"""The ZB-V table (parallel/zero_bubble_v.py), on its own: no JAX."""

import numpy as np
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.parallel import schedule, stage_order, zero_bubble, zero_bubble_v

IDLE = schedule.IDLE
SHAPES = [(2, 1), (2, 4), (3, 4), (4, 2), (4, 7), (4, 8), (4, 32), (8, 16), (16, 64), (35, 4)]


def _operations(table, kind):
    """{(micro, chunk): tick} of every forward, B or W ('fwd', 'bwd', 'w'), each once, each
    on the stage the V puts its chunk on."""
    done = {}
    micro, repeat = getattr(table, f'{kind}_micro'), getattr(table, f'{kind}_repeat')
    for t, s in zip(*np.nonzero(micro != IDLE)):
        chunk = int(stage_order.chunk_index(repeat[t, s], s, table.stages, v_shape=True))
        assert stage_order.stage_of(chunk, table.stages, v_shape=True) == s
        key = (int(micro[t, s]), chunk)
        assert key not in done, f'{kind} of {key} twice'
        done[key] = int(t)
    return done


@pytest.mark.parametrize('p,m', SHAPES)
def test_every_forward_b_and_w_once_in_dependency_order(p, m):
    """Chunk c's forward after c - 1's (a hand-off between ticks, the turn on stage p - 1
    too), its B after c + 1's, the last chunk's B in its forward's tick (it runs it), W at or
    after its B."""
    table = zero_bubble_v.build(p, m)
    assert table.v_shape and table.split and table.repeats == 2 and table.last_stage == 0
    fwd, b, w = (_operations(table, kind) for kind in ('fwd', 'bwd', 'w'))
    last = 2 * p - 1
    everything = {(i, c) for i in range(m) for c in range(2 * p)}
    assert set(fwd) == set(b) == set(w) == everything
    for i, c in everything:
        if c > 0:
            assert fwd[(i, c)] >= fwd[(i, c - 1)] + 1
        if c < last:
            assert b[(i, c)] >= b[(i, c + 1)] + 1 and b[(i, c)] > fwd[(i, c)]
        else:
            assert b[(i, c)] == fwd[(i, c)]
        assert w[(i, c)] >= b[(i, c)]  # in a tick: F, B, W


def _sent(table, t, s, act, grad):
    """What stage s's forward and B of tick t send, as the engine's hand-offs (tick_by_slot.py's
    send): y down to s + 1 and back up to s - 1, dx up to s - 1 and down to s + 1, the way
    back on stage p - 1 its own too (the turn), into act and grad {(stage, way): value}."""
    p, turn = table.stages, [s] if s == table.stages - 1 else []
    if table.fwd_micro[t, s] != IDLE:
        chunk = stage_order.chunk_index(table.fwd_repeat[t, s], s, p, v_shape=True)
        value = (int(table.fwd_micro[t, s]), int(chunk) + 1)
        act[(s + 1, 0)] = value
        act.update({(to, 1): value for to in [s - 1, *turn]})
    if table.bwd_micro[t, s] != IDLE:
        chunk = stage_order.chunk_index(table.bwd_repeat[t, s], s, p, v_shape=True)
        value = (int(table.bwd_micro[t, s]), int(chunk) - 1)
        grad.update({(to, 0): value for to in [s - 1, *turn]})
        grad[(s + 1, 1)] = value


@pytest.mark.parametrize('p,m', SHAPES)
def test_hand_offs_both_ways_land_where_the_slots_say(p, m):
    """Replay the table as the engine does (arrivals of both ways, forward, B, W): every
    forward finds its own input (chunk 0: the embedding), every B its residuals and output
    gradient (the last chunk's its input), every W the taps its B wrote."""
    table = zero_bubble_v.build(p, m)
    stash = np.full((p, table.stash_slots), None, object)
    resids = np.full((p, table.resid_slots), None, object)
    grads = np.full((p, table.grad_slots), None, object)
    tapped = np.full((p, table.tap_slots), None, object)
    ways = [(table.recv_act_slot, table.recv_grad_slot)]
    ways.append((table.recv_act_back_slot, table.recv_grad_back_slot))
    act_in, grad_in, last = {}, {}, 2 * p - 1
    for t in range(table.ticks):
        for s in range(p):
            for way, (act_slot, grad_slot) in enumerate(ways):
                if act_slot[t, s] != IDLE:
                    stash[s, act_slot[t, s]] = act_in.get((s, way))
                if grad_slot[t, s] != IDLE:
                    grads[s, grad_slot[t, s]] = grad_in.get((s, way))
        act_in, grad_in = {}, {}
        for s in range(p):
            if table.fwd_micro[t, s] != IDLE:
                r = table.fwd_repeat[t, s]
                key = (table.fwd_micro[t, s], stage_order.chunk_index(r, s, p, v_shape=True))
                if 0 < key[1] < last:
                    assert stash[s, table.fwd_slot[t, s]] == key
                    resids[s, table.fwd_resid_slot[t, s]] = key
                elif key[1] == 0:
                    resids[s, table.fwd_resid_slot[t, s]] = key
            if table.bwd_micro[t, s] != IDLE:
                r = table.bwd_repeat[t, s]
                key = (table.bwd_micro[t, s], stage_order.chunk_index(r, s, p, v_shape=True))
                if key[1] == last:
                    assert stash[s, table.bwd_slot[t, s]] == key
                else:
                    assert resids[s, table.bwd_resid_slot[t, s]] == key
                    assert grads[s, table.bwd_grad_slot[t, s]] == key
                tapped[s, table.bwd_tap_slot[t, s]] = key
            if table.w_micro[t, s] != IDLE:
                r = table.w_repeat[t, s]
                key = (table.w_micro[t, s], stage_order.chunk_index(r, s, p, v_shape=True))
                assert tapped[s, table.w_tap_slot[t, s]] == key
            _sent(table, t, s, act_in, grad_in)
    assert max(table.resid_slots, table.tap_slots) <= table.in_flight().max()


@pytest.mark.parametrize('p,m', [(2, 4), (4, 8), (4, 32), (8, 16), (16, 64), (35, 240)])
def test_memory_within_1f1bs(p, m):
    """A chunk is half a stage: the chunk inputs a stage holds (forward to W) and its
    residual slots, halved, stay within lockstep 1F1B's table (2 (p - s) - 1 stage inputs):
    at most 3p - 1 chunk inputs (the module docstring)."""
    zbv, one = zero_bubble_v.build(p, m), schedule.build(p, 1, m)
    assert zbv.in_flight().max() <= min(3 * p - 1, 2 * one.in_flight().max())
    assert zbv.resid_slots <= 2 * one.resid_slots


@pytest.mark.parametrize('p,m', [(2, 4), (3, 8), (4, 8), (4, 32), (8, 16), (8, 64), (16, 64)])
def test_bubble_is_the_start_up_and_the_first_bs_way_down(p, m):
    """F = B = W = 1 a chunk (the last chunk's forward 0, in its B's tick), lockstep ticks
    costing their slowest stage: the busiest stage (6 m units) waits 2 (p - 1) units, ZB-V's
    own p - 1 of start-up and p - 1 while the first B's reach the stages (the module
    docstring), whatever m >= p; below ZB-H1's table's bubble and interleaved 1F1B's (v = 2)
    from p = 4 on."""
    table = zero_bubble_v.build(p, m)
    time, work = table.tick_costs()
    assert work.max() == 6 * m and time.sum() - work.max() == 2 * (p - 1)
    assert table.bubble_fraction() == pytest.approx(zero_bubble_v.lockstep_bubble(p, m))
    ideal = zero_bubble_v.ideal_bubble(p, m) * (6 * m + p - 1)  # units
    assert time.sum() - work.max() - ideal == p - 1
    if p >= 4:
        assert table.bubble_fraction() < zero_bubble.build(p, m).bubble_fraction()
        assert table.bubble_fraction() < schedule.build(p, 2, m).bubble_fraction()


@pytest.mark.parametrize('p,m,bound', [(4, 8, 2), (4, 16, 4), (8, 32, 3), (3, 5, 1)])
def test_max_in_flight_bounds_the_micro_batches_in_the_pipeline(p, m, bound):
    """pipeline.max_in_flight: at most `bound` micro-batches between their chunk 0's forward
    and their last W, so at most 2 bound chunk inputs (bound stage inputs) a stage, paid for
    with idle ticks; every operation still runs once."""
    capped, free = zero_bubble_v.build(p, m, bound), zero_bubble_v.build(p, m)
    assert capped.in_flight().max() <= 2 * bound < free.in_flight().max()
    assert max(capped.resid_slots, capped.tap_slots) <= 2 * bound and capped.ticks > free.ticks
    assert (capped.w_micro != IDLE).sum() == 2 * p * m


def test_diagram_shows_the_second_chunk_in_lower_case():
    text = zero_bubble.diagram(zero_bubble_v.build(2, 4)).splitlines()
    assert text[1].split()[:4] == ['stage', '0', 'F0', 'F1']  # chunk 0, the embedding's
    assert 'f0b0' in text[1] and 'f0' in text[2].split()  # the loss on stage 0; the turn


def test_bad_shapes_and_repeats_are_refused():
    with pytest.raises(ValueError, match='must be >= 1'):
        zero_bubble_v.build(2, 0)
    with pytest.raises(ValueError, match='max_in_flight'):
        zero_bubble_v.build(2, 4, max_in_flight=0)
    with pytest.raises(config_lib.ConfigError, match='zbv runs two chunks') as error:
        config = config_lib.defaults()
        config.mesh.stage, config.pipeline.schedule = 2, 'zbv'
        config_lib.resolve(config, 2)
    assert error.value.key == 'pipeline.repeats'


@pytest.mark.parametrize('first,last', [(0, 0), (2, 4)])
def test_the_v_is_one_more_mapping_of_the_stored_order(first, last):
    """Stage s stores chunks s and 2p - 1 - s, in that order (equal stages, and 2 + 4 + 4 + 4
    layers with stage 0's chunks one layer each, padded): the layer-order round trip is exact,
    so checkpoints stay in layer order and restore under any schedule."""
    layers = 14 if first else 16
    layout = stage_order.StageLayers(layers, 4, 2, first, last, v_shape=True)
    held = layout.storage().reshape(4, 2, layout.slots)
    for s in range(4):
        for r, chunk in enumerate((s, 7 - s)):
            placed = held[s, r][held[s, r] >= 0]
            assert placed[0] == layout.first_layers[r, s] and len(placed) >= 1
            later = layout.first_layers.reshape(-1) > layout.first_layers[r, s]
            assert later.sum() == 7 - chunk  # the chunk's place in the model's order
    tree = {'blocks': np.arange(layers, dtype=np.float32) + 1, 'other': np.ones(2)}
    stored = stage_order.to_schedule_order(tree, layout)
    assert stored['blocks'].shape == (layout.stored_layers,)
    back = stage_order.to_layer_order(stored, layout)
    np.testing.assert_array_equal(back['blocks'], tree['blocks'])
