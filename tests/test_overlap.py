"""The overlap replay (plan/overlap.py) on hand-written scheduled modules whose answer is known:
wire time = wire bytes / link bandwidth, compute = FLOPs / peak or bytes / HBM bandwidth."""

import pytest

from mtnlg_jax.plan import overlap, pgle

# Round figures: 1e12 FLOP/s, 1e9 B/s of HBM, NVLink 1e6 B/s, network 1e5 B/s, 2 GPUs a node.
TARGET = overlap.Target(1e12, 1e9, 1e6, 1e5, gpus_per_node=2)
MESH = dict(data=2, stage=1, tensor=2)

HEADER = """HloModule scheduled, is_scheduled=true, num_partitions=4

%fused_dot (a: f32[1000,1000], b: f32[1000,1000]) -> f32[1000,1000] {
  %a = f32[1000,1000]{1,0} parameter(0)
  %b = f32[1000,1000]{1,0} parameter(1)
  ROOT %d = f32[1000,1000]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
# One all-gather over 'tensor' (pairs {0,1}, {2,3}: inside a node) of 4,000 bytes: each device
# sends 2,000 bytes = 2 ms on NVLink. The dot: 2e9 FLOPs = 2 ms at peak (its 12 MB of operands
# and result take 12 ms of HBM: the roofline says 12 ms).
BESIDE = (
    HEADER
    + """
ENTRY %main (x: f32[500], w: f32[1000,1000]) -> (f32[1000], f32[1000,1000]) {
  %x = f32[500]{0} parameter(0)
  %w = f32[1000,1000]{1,0} parameter(1)
  %ags = (f32[500]{0}, f32[1000]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
  %f = f32[1000,1000]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %agd = f32[1000]{0} all-gather-done(%ags)
  ROOT %out = (f32[1000]{0}, f32[1000,1000]{1,0}) tuple(%agd, %f)
}
"""
)
AFTER = BESIDE.replace(
    """  %f = f32[1000,1000]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %agd = f32[1000]{0} all-gather-done(%ags)""",
    """  %agd = f32[1000]{0} all-gather-done(%ags)
  %f = f32[1000,1000]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot""",
)


def _only_row(result):
    (row,) = result['collectives']
    return row


def test_a_collective_with_compute_between_start_and_done_is_hidden():
    result = overlap.collective_overlap(BESIDE, MESH, TARGET)
    row = _only_row(result)
    assert row['link'] == 'nvlink' and row['axes'] == ['tensor']
    assert row['wire_s'] == pytest.approx(2e-3)
    assert row['exposed_s'] == pytest.approx(0.0)
    assert result['step_s'] == pytest.approx(12e-3)  # the fusion's HBM time
    assert result['table'][0]['overlapped'] == pytest.approx(1.0)
    assert result['heaviest'] == []  # matmuls are the model's work, not a share to fix


def test_a_collective_awaited_at_once_is_exposed_whole():
    result = overlap.collective_overlap(AFTER, MESH, TARGET)
    row = _only_row(result)
    assert row['exposed_s'] == pytest.approx(2e-3)
    assert result['step_s'] == pytest.approx(14e-3)
    assert result['compute_s'] == pytest.approx(12e-3)
    assert result['table'][0]['overlapped'] == pytest.approx(0.0)


def test_a_short_window_hides_part_and_groups_across_nodes_use_the_network():
    """Over 'data' (pairs {0,2}, {1,3}: across nodes) the same bytes take 20 ms on the network;
    12 ms of compute between start and done hide 12 of them."""
    text = BESIDE.replace('replica_groups={{0,1},{2,3}}', 'replica_groups={{0,2},{1,3}}')
    row = _only_row(overlap.collective_overlap(text, MESH, TARGET))
    assert row['link'] == 'network' and row['axes'] == ['data']
    assert row['wire_s'] == pytest.approx(20e-3)
    assert row['exposed_s'] == pytest.approx(8e-3)


def test_collectives_on_one_link_queue_behind_each_other():
    """Two all-gathers started together share NVLink: the second arrives after both (4 ms);
    the 12 ms fusion hides them both; awaited at once, they cost 2 + 2 ms."""
    second = (
        '  %ags2 = (f32[500]{0}, f32[1000]{0}) all-gather-start(%x), channel_id=2, '
        'replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true\n'
    )
    done2 = '  %agd2 = f32[1000]{0} all-gather-done(%ags2)\n'
    text = AFTER.replace('  %agd = ', second + done2 + '  %agd = ')
    result = overlap.collective_overlap(text, MESH, TARGET)
    exposed = sorted(row['exposed_s'] for row in result['collectives'])
    assert exposed == pytest.approx([0.0, 4e-3])  # ags: arrived during ags2's wait
    assert result['exposed_s'] == pytest.approx(4e-3)


SLOT_WRITES = {
    'the buffer itself': """
  %buffer = f32[1000,1000]{1,0} parameter(0)
  %update = f32[1,1000]{1,0} parameter(1)
  %slot = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[1000,1000]{1,0} dynamic-update-slice(%buffer, %update, %slot, %zero)""",
    # as XLA:GPU writes the pipeline's gradient accumulators: buffer and update bitcast to
    # another shape; its buffer assignment gives the output the parameter's allocation
    'the buffer through bitcasts': """
  %buffer = f32[1000,1000]{1,0} parameter(0)
  %b3 = f32[1000,1,1000]{2,1,0} bitcast(%buffer)
  %update = f32[1,1000]{1,0} parameter(1)
  %u3 = f32[1,1,1000]{2,1,0} bitcast(%update)
  %slot = s32[] parameter(2)
  %zero = s32[] constant(0)
  %dus = f32[1000,1,1000]{2,1,0} dynamic-update-slice(%b3, %u3, %slot, %zero, %zero)
  ROOT %out = f32[1000,1000]{1,0} bitcast(%dus)""",
}
# an accumulator's slot, read, added to and written back in one in-place fusion (what
# XLA:GPU makes of `acc.at[i].add(g)`): the slot is read too, so 3 x 4,000 bytes
SLOT_READ_AND_WRITTEN = """
  %buffer = f32[1000,1000]{1,0} parameter(0)
  %update = f32[1,1000]{1,0} parameter(1)
  %slot = s32[] parameter(2)
  %zero = s32[] constant(0)
  %old = f32[1,1000]{1,0} dynamic-slice(%buffer, %slot, %zero), dynamic_slice_sizes={1,1000}
  %sum = f32[1,1000]{1,0} add(%old, %update)
  ROOT %dus = f32[1000,1000]{1,0} dynamic-update-slice(%buffer, %sum, %slot, %zero)"""


def _slot_module(body):
    return (
        """HloModule slots, is_scheduled=true, num_partitions=4

%write (buffer: f32[1000,1000], update: f32[1,1000], slot: s32[]) -> f32[1000,1000] {"""
        + body
        + """
}

ENTRY %main (b: f32[1000,1000], u: f32[1,1000], i: s32[]) -> f32[1000,1000] {
  %b = f32[1000,1000]{1,0} parameter(0)
  %u = f32[1,1000]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[1000,1000]{1,0} fusion(%b, %u, %i), kind=kLoop, calls=%write
}
"""
    )


@pytest.mark.parametrize('body', SLOT_WRITES.values(), ids=SLOT_WRITES.keys())
def test_a_stash_slot_written_in_place_costs_its_update_not_its_buffer(body):
    """A fusion that writes one slot (4,000 bytes) of a 4 MB buffer in place, as the pipeline
    stores a micro-batch's residuals: 8 us of HBM (the update read and written), not 8 ms."""
    result = overlap.collective_overlap(_slot_module(body), MESH, TARGET)
    assert result['step_s'] == pytest.approx(2 * 4000 / 1e9 + 4 / 1e9)
    (heaviest,) = result['heaviest']  # the one instruction, named by its kind and type
    assert heaviest['kind'] == 'slicing and slot writes' and heaviest['runs'] == 1
    assert heaviest['type'] == 'f32[1000,1000]'
    assert heaviest['seconds'] == pytest.approx(result['step_s'])


def test_a_slot_added_to_in_place_costs_its_read_too():
    """acc[i] += update in one fusion: the slot read, the update read, the slot written."""
    result = overlap.collective_overlap(_slot_module(SLOT_READ_AND_WRITTEN), MESH, TARGET)
    assert result['step_s'] == pytest.approx(3 * 4000 / 1e9 + 4 / 1e9)


FP8_GEMMS = """HloModule scheduled, is_scheduled=true, num_partitions=4

%fused_f8 (a: f8e4m3fn[1000,1000], b: f8e4m3fn[1000,1000]) -> f32[1000,1000] {
  %a = f8e4m3fn[1000,1000]{1,0} parameter(0)
  %b = f8e4m3fn[1000,1000]{1,0} parameter(1)
  ROOT %d = f32[1000,1000]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_widened (a: f8e4m3fn[1000,1000], b: f8e4m3fn[1000,1000]) -> f32[1000,1000] {
  %a = f8e4m3fn[1000,1000]{1,0} parameter(0)
  %b = f8e4m3fn[1000,1000]{1,0} parameter(1)
  %wa = bf16[1000,1000]{1,0} convert(%a)
  %wb = bf16[1000,1000]{1,0} convert(%b)
  ROOT %d = f32[1000,1000]{1,0} dot(%wa, %wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f8e4m3fn[1000,1000], w: f8e4m3fn[1000,1000]) -> (f32[1000,1000], f32[1000,1000]) {
  %x = f8e4m3fn[1000,1000]{1,0} parameter(0)
  %w = f8e4m3fn[1000,1000]{1,0} parameter(1)
  %f8 = f32[1000,1000]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_f8
  %wide = f32[1000,1000]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_widened
  ROOT %out = (f32[1000,1000]{1,0}, f32[1000,1000]{1,0}) tuple(%f8, %wide)
}
"""


def test_a_gemm_of_fp8_operands_runs_at_the_fp8_peak_and_a_widened_one_at_the_compute_dtypes():
    """Two 2e9-FLOP GEMM fusions (HBM fast enough not to matter): the one multiplying FP8
    operands takes 1 ms at an FP8 peak of 2e12, the one converting them to bf16 first 2 ms at
    the compute dtype's 1e12; without FP8 tensor cores (an A100) both take 2 ms."""
    fp8 = overlap.Target(1e12, 1e15, 1e6, 1e5, gpus_per_node=2, fp8_peak_flops=2e12)
    assert overlap.collective_overlap(FP8_GEMMS, MESH, fp8)['step_s'] == pytest.approx(3e-3)
    none = overlap.Target(1e12, 1e15, 1e6, 1e5, gpus_per_node=2)
    assert overlap.collective_overlap(FP8_GEMMS, MESH, none)['step_s'] == pytest.approx(4e-3)


LOOP = """HloModule loop, is_scheduled=true, num_partitions=4

%scale (a: f32[1000]) -> f32[1000] {
  %a = f32[1000]{0} parameter(0)
  ROOT %m = f32[1000]{0} multiply(%a, %a)
}

%body (p: (s32[], f32[1000], f32[1000,1000])) -> (s32[], f32[1000], f32[1000,1000]) {
  %p = (s32[], f32[1000]{0}, f32[1000,1000]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1000]{0} get-tuple-element(%p), index=1
  %buffer = f32[1000,1000]{1,0} get-tuple-element(%p), index=2
  %zero = s32[] constant(0)
  %row = f32[1,1000]{1,0} dynamic-slice(%buffer, %i, %zero), dynamic_slice_sizes={1,1000}
  %y = f32[1000]{0} fusion(%x), kind=kLoop, calls=%scale
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1000]{0}, f32[1000,1000]{1,0}) tuple(%next, %y, %buffer)
}

%cond (p: (s32[], f32[1000], f32[1000,1000])) -> pred[] {
  %p = (s32[], f32[1000]{0}, f32[1000,1000]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1000], b: f32[1000,1000]) -> (s32[], f32[1000], f32[1000,1000]) {
  %x = f32[1000]{0} parameter(0)
  %b = f32[1000,1000]{1,0} parameter(1)
  %ags = (f32[1000]{0}, f32[2000]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[2000]{0} all-gather-done(%ags)
  %start = s32[] constant(0)
  %init = (s32[], f32[1000]{0}, f32[1000,1000]{1,0}) tuple(%start, %x, %b)
  ROOT %w = (s32[], f32[1000]{0}, f32[1000,1000]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_hbm_bytes_count_each_kernel_by_its_runs_a_slot_by_its_slice_and_no_collective():
    """Each of the loop's 5 trips: a 4,000-byte fusion read and written (8,000), a 4,000-byte
    row sliced from a 4 MB buffer (8,000, not the buffer's 4 MB), the counter's add (12
    bytes); the all-gather none; the condition none, as the replay prices a loop by its body:
    80,060 bytes."""
    assert overlap.hbm_bytes(LOOP) == 5 * (8000 + 8000 + 12)


# Activation offload: a stash buffer of 10 rows (40,000 bytes) in pinned host memory (layout
# memory space S(5)), one row (4,000 bytes) fetched by an async dynamic-slice fusion, as
# XLA:GPU emits it: over a host link of 1e6 B/s, 4 ms. The dot fusion after its start takes
# 12 ms (HBM); the negate 8 us.
HOST_TARGET = overlap.Target(1e12, 1e9, 1e6, 1e5, gpus_per_node=2, host_bandwidth=1e6)
FETCH = (
    HEADER
    + """
%wrapped_slice (p0: f32[10,1000], p1: s32[]) -> f32[1,1000] {
  %p0 = f32[10,1000]{1,0:S(5)} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,1000]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,1000}
}

ENTRY %main (h: f32[10,1000], i: s32[], w: f32[1000,1000], v: f32[1000]) -> (f32[1,1000], f32[1000,1000], f32[1000]) {
  %h = f32[10,1000]{1,0:S(5)} parameter(0)
  %i = s32[] parameter(1)
  %w = f32[1000,1000]{1,0} parameter(2)
  %v = f32[1000]{0} parameter(3)
  %dss = ((f32[10,1000]{1,0:S(5)}, s32[]), f32[1,1000]{1,0}, u32[]) fusion-start(%h, %i), kind=kLoop, calls=%wrapped_slice
  %f = f32[1000,1000]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %n = f32[1000]{0} negate(%v)
  %dsd = f32[1,1000]{1,0} fusion-done(%dss)
  ROOT %out = (f32[1,1000]{1,0}, f32[1000,1000]{1,0}, f32[1000]{0}) tuple(%dsd, %f, %n)
}
"""
)
FETCH_AWAITED = FETCH.replace(
    '  %f = f32[1000,1000]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot\n', ''
).replace(
    '  ROOT %out = ',
    '  %f = f32[1000,1000]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot\n  ROOT %out = ',
)


def test_a_row_fetched_from_host_memory_behind_compute_is_hidden_and_costs_its_slice():
    result = overlap.collective_overlap(FETCH, MESH, HOST_TARGET)
    host = result['host']
    assert host['bytes'] == host['from_host_bytes'] == 4000 and host['to_host_bytes'] == 0
    assert host['transfer_s'] == pytest.approx(4e-3)  # the row, not the 40,000-byte buffer
    assert host['exposed_s'] == 0.0 and host['count'] == 1
    assert result['step_s'] == pytest.approx(12e-3 + 8e-6)  # compute alone
    assert result['time_by_kind']['exposed host transfers'] == 0.0
    assert result['collectives'] == [] and result['exposed_s'] == 0.0
    # XLA's latency profile (plan/pgle.py) costs the start at its link time, not as compute
    assert dict(pgle.costs(result['replay']))['dss'] == pytest.approx(4e-3)


def test_a_row_fetched_with_too_little_compute_between_is_exposed():
    """Only the 8 us negate between start and done: the compute stream waits 4 ms - 8 us."""
    result = overlap.collective_overlap(FETCH_AWAITED, MESH, HOST_TARGET)
    assert result['host']['exposed_s'] == pytest.approx(4e-3 - 8e-6)
    assert result['time_by_kind']['exposed host transfers'] == pytest.approx(4e-3 - 8e-6)
    assert result['step_s'] == pytest.approx(4e-3 + 12e-3)
    assert result['compute_s'] == pytest.approx(12e-3 + 8e-6)
    assert result['exposed_s'] == 0.0  # the collectives' share: none


def test_the_same_module_without_host_memory_replays_as_before():
    """Without S(5) the fusion-start is compute, priced as it always was: its whole tuple type
    written, the row read for the buffer and again for the index the slice alone reads (52,008
    bytes); with or without a host link."""
    text = FETCH.replace(':S(5)', '')
    before = overlap.collective_overlap(text, MESH, TARGET)
    after = overlap.collective_overlap(text, MESH, HOST_TARGET)
    assert after['step_s'] == before['step_s'] == pytest.approx(12e-3 + 8e-6 + 52008 / 1e9)
    assert after['time_by_kind'] == before['time_by_kind']
    assert after['host']['bytes'] == after['host']['count'] == 0
    # with no host link figure (a target built by hand), host memory is not told apart
    assert overlap.collective_overlap(FETCH, MESH, TARGET)['step_s'] == before['step_s']


def test_a_slot_written_to_host_costs_its_update_and_a_synchronous_copy_is_exposed_whole():
    """A row written into the host buffer by an async dynamic-update-slice fusion awaited at
    once (4,000 bytes: 4 ms exposed, not the buffer's 40 ms), then a synchronous copy of a
    row to host memory (4 ms, exposed whole), queued on the same host stream; a buffer XLA
    allocates in host memory (AllocateBuffer: the engine's slots, parallel/offload.py) moves
    nothing."""
    text = (
        HEADER
        + """
%wrapped_update (p0: f32[10,1000], p1: f32[1,1000], p2: s32[]) -> f32[10,1000] {
  %p0 = f32[10,1000]{1,0:S(5)} parameter(0)
  %p1 = f32[1,1000]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[10,1000]{1,0:S(5)} dynamic-update-slice(%p0, %p1, %p2, %zero)
}

ENTRY %main (h: f32[10,1000], r: f32[1,1000], i: s32[]) -> (f32[10,1000], f32[1,1000], f32[10,1000]) {
  %h = f32[10,1000]{1,0:S(5)} parameter(0)
  %r = f32[1,1000]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %uss = ((f32[10,1000]{1,0:S(5)}, f32[1,1000]{1,0}, s32[]), f32[10,1000]{1,0:S(5)}, u32[]) fusion-start(%h, %r, %i), kind=kLoop, calls=%wrapped_update
  %usd = f32[10,1000]{1,0:S(5)} fusion-done(%uss)
  %c = f32[1,1000]{1,0:S(5)} copy(%r)
  %a = f32[10,1000]{1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %out = (f32[10,1000]{1,0:S(5)}, f32[1,1000]{1,0:S(5)}, f32[10,1000]{1,0:S(5)}) tuple(%usd, %c, %a)
}
"""
    )
    result = overlap.collective_overlap(text, MESH, HOST_TARGET)
    host = result['host']
    assert host['to_host_bytes'] == 8000 and host['from_host_bytes'] == 0
    assert host['transfer_s'] == pytest.approx(8e-3) and host['count'] == 2
    assert host['exposed_s'] == pytest.approx(8e-3) == result['step_s']
    assert result['compute_s'] == pytest.approx(0.0)


def test_a_row_fetched_and_a_row_written_share_no_stream():
    """PCIe is full duplex: a fetch from the host and a write to it started together both
    arrive 4 ms later (a stream each way), not one after the other."""
    text = FETCH_AWAITED.replace(
        '  %dsd = f32[1,1000]{1,0} fusion-done(%dss)\n',
        '  %cs = (f32[1,1000]{1,0:S(5)}, f32[1,1000]{1,0}, u32[]) copy-start(%n1)\n'
        '  %dsd = f32[1,1000]{1,0} fusion-done(%dss)\n'
        '  %cd = f32[1,1000]{1,0:S(5)} copy-done(%cs)\n',
    ).replace(
        '  %n = f32[1000]{0} negate(%v)\n',
        '  %n = f32[1000]{0} negate(%v)\n  %n1 = f32[1,1000]{1,0} bitcast(%n)\n',
    )
    result = overlap.collective_overlap(text, MESH, HOST_TARGET)
    assert result['host']['to_host_bytes'] == result['host']['from_host_bytes'] == 4000
    assert result['host']['transfer_s'] == pytest.approx(8e-3)
    # the fetch waited for from the start, the write (started 8 us later) 8 us more: 4 ms,
    # where one stream for both would make it 8 ms
    assert result['host']['exposed_s'] == pytest.approx(4e-3)


def test_a_clusters_target_carries_its_host_link():
    from mtnlg_jax.plan import clusters  # noqa: PLC0415

    for name, bandwidth in (('a100-80gb', 25e9), ('h100-80gb', 50e9), ('h200-141gb', 50e9)):
        target = overlap.Target.of_cluster(clusters.CLUSTERS[name], 'bfloat16')
        assert target.host_bandwidth == bandwidth
