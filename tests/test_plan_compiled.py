"""The compiled step read through the planner's own tools.

1. The collective inventory: every replica-group form, async pairs, loop trip counts, weighted
   conditional branches (on hand-written modules), and the structure of compiled train and eval steps read through it:
   Megatron's tensor-parallel all-reduces per layer, pipeline hand-offs over 'stage', and no
   buffer with the full padded vocabulary on any device.
2. The planner against the same compiles: memory per device and collective bytes per step
   within 10 %, for a tensor-parallel, a bf16 data-parallel and a pipelined (interleaved
   1F1B) layout."""

import functools
import math

import jax
import pytest

import support
from mtnlg_jax.parallel import branches, pipeline
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import arithmetic, hlo, hlo_module, report

MESH = dict(data=2, stage=2, tensor=2)  # device id = 4 data + 2 stage + tensor
TOLERANCE = 0.10


@functools.lru_cache(maxsize=None)
def compiled_step(name, step='train'):
    """(config, compiled, info) of a PLAN_LAYOUTS layout's train or eval step, compiled ahead
    of time by mtnlg_jax.plan.compile (what launch/plan.py --compile measures)."""
    config = support.plan_config(name)
    make = compile_lib.compile_train_step if step == 'train' else compile_lib.compile_eval_step
    compiled, _, info = make(config)
    return config, compiled, info


MODULE = """HloModule hand_written, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%scatter (p: f32[8,16]) -> f32[4,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %rs = f32[4,16]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

%inner_body (t: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %t = (s32[], f32[4,8]{1,0}, /*index=2*/f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%t), index=2
  %ar = f32[4,8]{1,0} all-reduce(%v), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(1,0,2), use_global_device_ids=true, to_apply=%add
  %ags = (f32[2,8]{1,0}, f32[4,8]{1,0}) all-gather-start(%ar), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[4,8]{1,0} all-gather-done(%ags)
  %rss = ((f32[8,16]{1,0}), f32[4,16]{1,0}) async-start(%w), calls=%scatter
  %rsd = f32[4,16]{1,0} async-done(%rss), calls=%scatter
  ROOT %out = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %agd, %w)
}

%inner_cond (t: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %five), direction=LT
}

%exchange (v: f32[4,8]) -> f32[4,8] {
  %v = f32[4,8]{1,0} parameter(0)
  ROOT %a2a = f32[4,8]{1,0} all-to-all(%v), channel_id=6, replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, dimensions={0}
}

%outer_body (t: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %inner = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%t), condition=%inner_cond, body=%inner_body
  %v = f32[4,8]{1,0} get-tuple-element(%inner), index=1
  %perm = f32[4,8]{1,0} collective-permute(%v), channel_id=4, source_target_pairs={{0,2},{2,0},{1,3},{3,1},{4,6},{6,4},{5,7},{7,5}}
  %called = f32[4,8]{1,0} call(%perm), to_apply=%exchange
  ROOT %out = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %called, %w)
}

%outer_cond (t: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %big = s32[] constant(1000)
  ROOT %lt = pred[] compare(%i, %big), direction=LT
}

ENTRY %main (p0: (s32[], f32[4,8], f32[8,16]), p1: bf16[6,8]) -> f32[4,8] {
  %p0 = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %p1 = bf16[6,8]{1,0} parameter(1)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%p0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %sub = bf16[6,8]{1,0} all-reduce(%p1), channel_id=5, replica_groups=mesh['x'=8] {'x':(2)2}, use_global_device_ids=true, to_apply=%add
  %every = (f32[], s32[2]{0}) all-reduce(%p1, %p1), channel_id=7, replica_groups={}, to_apply=%add
  %r = f32[4,8]{1,0} get-tuple-element(%loop), index=1
  %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%r), channel_id=8, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4,8]{1,0} collective-permute-done(%cps)
  %ars = f32[4,8]{1,0} all-reduce-start(%cpd), channel_id=9, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %sizes = s64[2]{0} constant({0, 4})
  %r2a = ((f32[4,8]{1,0}, f32[4,8]{1,0}, s64[2]{0}, s64[2]{0}, s64[2]{0}, /*index=5*/s64[2]{0}), f32[4,8]{1,0}) ragged-all-to-all-start(%r, %r, %sizes, %sizes, %sizes, /*index=5*/%sizes), channel_id=10, replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %r2ad = f32[4,8]{1,0} ragged-all-to-all-done(%r2a)
  ROOT %ard = f32[4,8]{1,0} all-reduce-done(%ars)
}
"""


def _by_name(inventory):
    return {entry['name']: entry for entry in inventory}


def test_inventory_of_a_hand_written_module():
    ops = _by_name(hlo.collective_inventory(MODULE, MESH))
    assert set(ops) == {'ar', 'ags', 'rs', 'perm', 'a2a', 'sub', 'every', 'cps', 'ars', 'r2a'}
    expected = {  # name: (kind, axes, bytes, count, in_loop, wire bytes per run)
        'ar': ('all-reduce', ('tensor',), 128, 15, True, 128.0),
        'ags': ('all-gather', ('data',), 128, 15, True, 64.0),
        'rs': ('reduce-scatter', ('tensor',), 512, 15, True, 256.0),
        'perm': ('collective-permute', ('stage',), 128, 3, True, 128.0),
        'a2a': ('all-to-all', ('tensor',), 128, 3, True, 64.0),
        'sub': ('all-reduce', ('stage',), 96, 1, False, 96.0),
        'every': ('all-reduce', ('data', 'stage', 'tensor'), 12, 1, False, 2 * 7 / 8 * 12),
        'cps': ('collective-permute', ('tensor',), 128, 1, False, 128.0),
        'ars': ('all-reduce', ('data', 'stage', 'tensor'), 128, 1, False, 2 * 7 / 8 * 128),
        # its output buffer, as if full: the sizes it sends are known only when it runs
        'r2a': ('ragged-all-to-all', ('tensor',), 128, 1, False, 64.0),
    }  # -done halves are not counted again
    for name, (kind, axes, size, count, in_loop, wire) in expected.items():
        op = ops[name]
        got = (op['kind'], op['axes'], op['bytes'], op['count'], op['in_loop'], op['wire_bytes'])
        assert got == (kind, axes, size, count, in_loop, wire), name
    assert ops['every']['group_size'] == 8 and ops['ar']['group_size'] == 2

    totals = hlo.totals(hlo.collective_inventory(MODULE, MESH))
    assert totals['all-reduce', ('tensor',)] == dict(
        ops=1, count=15, bytes=15 * 128, wire_bytes=15 * 128.0
    )
    by_axis = hlo.wire_bytes_by_axis(hlo.collective_inventory(MODULE, MESH))
    assert by_axis['stage'] == 3 * 128 + 96


CONDITIONAL = """HloModule branches, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%run (v: f32[4,8]) -> f32[4,8] {
  %v = f32[4,8]{1,0} parameter(0)
  ROOT %ar = f32[4,8]{1,0} all-reduce(%v), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
}

%idle (v: f32[4,8]) -> f32[4,8] {
  ROOT %v = f32[4,8]{1,0} parameter(0)
}

ENTRY %main (i: s32[], p: f32[4,8]) -> f32[4,8] {
  %i = s32[] parameter(0)
  %p = f32[4,8]{1,0} parameter(1)
  ROOT %c = f32[4,8]{1,0} conditional(%i, %p, %p), branch_computations={%run, %idle}, metadata={op_name="jit(step)/while/body/pipeline_forward/cond"}
}
"""


def test_conditional_branches_weighted_by_their_scope():
    """Without weights a branch counts as taken; with the engine's fractions for the scope
    path in the conditional's op_name, as often as the table takes it."""
    (taken,) = hlo.collective_inventory(CONDITIONAL, MESH)
    assert taken['name'] == 'ar' and taken['count'] == 1
    weights = {(branches.FORWARD,): [0.25, 0.75], (branches.FORWARD, branches.FIRST): [1, 0]}
    (weighted,) = hlo.collective_inventory(CONDITIONAL, MESH, weights)
    assert weighted['count'] == 0.25
    scopes = {branches.BACKWARD, branches.FIRST}
    path = 'a/pipeline_backward/cond/branch_0_fun/transpose(jvp(pipeline_first))/cond'
    assert hlo_module.scope_path(path, scopes) == (branches.BACKWARD, branches.FIRST)


def test_replica_groups_map_to_mesh_axes_of_a_jax_mesh():
    """The same text under a mesh with other axis sizes: ids are positions in its device array."""
    ops = _by_name(hlo.collective_inventory(MODULE, dict(data=1, stage=4, tensor=2)))
    assert ops['ags']['axes'] == ('stage',)  # {0,4}: stage 0 and 2 of data 0
    assert ops['perm']['axes'] == ('stage',)
    assert ops['sub']['axes'] == ('stage',)


@pytest.fixture(scope='module')
def tensor_step():
    """Train step, data 2 x tensor 4, no recompute, 2 micro-steps of 4 sequences, 2 layers."""
    config, compiled, info = compiled_step('tensor')
    return config, compiled.as_text(), info


@pytest.fixture(scope='module')
def pipelined_step():
    """Train step, data 2 x stage 2 x tensor 2, circular pipeline of 2 repeats, 4 layers,
    4 micro-batches."""
    config, compiled, info = compiled_step('pipelined')
    return config, compiled.as_text(), info


def _activation_bytes(config):
    rows = config.train.micro_batch
    return rows * config.model.seq_len * config.model.hidden * 4  # fp32 compute


def test_megatron_tensor_collectives_per_layer(tensor_step):
    """Per layer and micro-batch: 2 all-reduces of the (rows, seq, hidden) activation forward
    (attention out, MLP out) and 2 backward (their column-parallel inputs), nothing else over
    'tensor' inside the layer loop; the vocabulary-parallel embedding and head add one each
    per micro-batch (forward lookup, backward input gradient)."""
    config, text, info = tensor_step
    inventory = hlo.collective_inventory(text, info['mesh'])
    layer_runs = config.train.micro_steps * config.model.num_layers
    in_layers = [e for e in inventory if 'tensor' in e['axes'] and e['count'] == layer_runs]
    assert len(in_layers) == 4
    assert all(
        e['kind'] == 'all-reduce'
        and e['axes'] == ('tensor',)
        and e['bytes'] == (_activation_bytes(config))
        for e in in_layers
    )
    per_micro = [
        e['bytes'] * e['count'] / config.train.micro_steps
        for e in inventory
        if e['axes'] == ('tensor',) and e['count'] >= config.train.micro_steps
        and e['count'] != layer_runs
    ]  # fmt: skip
    tokens = config.train.micro_batch * config.model.seq_len
    # embedding forward + head backward, each an activation; up to 3 fp32 numbers a token
    assert 2 * _activation_bytes(config) <= sum(per_micro)
    assert sum(per_micro) <= 2 * _activation_bytes(config) + 3 * 4 * tokens
    assert max(per_micro) <= _activation_bytes(config)


def test_pipeline_moves_activations_over_stage_only(pipelined_step):
    """Inside the pipeline's tick loop (the interleaved 1F1B table's ticks): one hand-off of
    the activation forward and one of its gradient backward per tick over 'stage', each split
    over 'tensor' along the sequence (Megatron's scatter/gather); nothing else over 'stage'
    in the loop."""
    config, text, info = pipelined_step
    inventory = hlo.collective_inventory(text, info['mesh'])
    ticks = pipeline.num_ticks(config.mesh.stage, config.pipeline.repeats, config.train.micro_steps)
    handoff = _activation_bytes(config) // config.mesh.tensor
    permutes = [e for e in inventory if e['kind'] == 'collective-permute' and e['in_loop']]
    assert [(e['axes'], e['count'], e['bytes']) for e in permutes] == [
        (('stage',), ticks, handoff)
    ] * 2  # forward and backward
    over_stage = [e for e in inventory if 'stage' in e['axes'] and e not in permutes]
    assert not [e for e in over_stage if e['in_loop']]
    # Sums over 'stage': the loss and the gradients of the parameters outside the block stack
    # (fp32, as split over 'tensor'), nothing of the size of the micro-batches' activations.
    setup = info['setup']
    shared = {k: v for k, v in setup.abstract_state['params'].items() if k != 'blocks'}
    shardings = {k: v for k, v in setup.compute_shardings.items() if k != 'blocks'}
    shared_bytes = sum(
        math.prod(sharding.shard_shape(leaf.shape)) * 4
        for leaf, sharding in zip(jax.tree.leaves(shared), jax.tree.leaves(shardings))
    )
    sums = sum(e['bytes'] for e in over_stage if e['kind'] == 'all-reduce')
    assert sums <= shared_bytes + 1024


def _full_vocab_buffers(config, text):
    vocab = config.model.padded_vocab
    shards = vocab // config.mesh.tensor
    piece = config.model.seq_len // config.model.loss_chunks
    shapes = hlo_module.array_shapes(text)
    full = [s for s in shapes if vocab in s[1]]
    split = [s for s in shapes if shards in s[1] and piece in s[1]]
    return full, split


@pytest.mark.parametrize('layout', ['tensor', 'pipelined'])
def test_no_buffer_holds_the_full_padded_vocabulary(layout):
    """Neither the train step nor the eval step, pipelined or not, has any array with the full
    padded vocabulary (1536: no other dimension of these models is a multiple of it) on a
    device; the vocabulary-split logits of a piece of the sequence (rows, seq / loss_chunks,
    1536 / tensor) are there."""
    config, train, _ = compiled_step(layout)
    _, evaluate, _ = compiled_step(layout, 'eval')
    assert config.model.padded_vocab == 1536 and math.gcd(1536, config.model.hidden) < 1536
    for text in (train.as_text(), evaluate.as_text()):
        full, split = _full_vocab_buffers(config, text)
        assert not full, f'full-vocabulary buffers: {full}'
        assert split, 'expected vocabulary-split logits'


def _planned_and_compiled(name):
    config, compiled, info = compiled_step(name)
    plan = report.add_compiled(report.make_plan(config), config, compiled, info)
    return config, plan['compiled']['planned_as_compiled'], plan['compiled'], compiled, info


def _close(got, planned):
    return abs(got - planned) <= TOLERANCE * planned


@pytest.mark.parametrize('name', ['tensor', 'data_bf16', 'pipelined'])
def test_planned_memory_per_device(name):
    """Planned bytes per device (state and activations, no second copy of the optimizer
    state: XLA updates it in place) against memory_analysis()'s arguments + unaliased outputs
    + temporaries, under selective recompute (the layer's count measured to 1 %: the next
    test). A bf16 step is compared with the plan of its fp32 twin: XLA:CPU computes it in
    fp32 (report.cpu_equivalent)."""
    config = support.plan_config(name, remat='selective')
    compiled, _, info = compile_lib.compile_train_step(config)
    planned = report.add_compiled(report.make_plan(config), config, compiled, info)['compiled']
    total = planned['planned_as_compiled']['per_device_bytes']['total']
    assert _close(planned['peak_bytes'], total), (planned['peak_bytes'], total)


@functools.lru_cache(maxsize=None)  # remat full ignores `recompute`: cases share its compiles
def _temporaries(block, remat, layers, sequence_parallel, recompute=''):
    config = support.small_config(
        tensor=4, remat=remat, num_layers=layers, seq_len=256, vocab_size=512,
        sequence_parallel=sequence_parallel, **(support.LLAMA_BLOCK if block == 'llama' else {}),
        remat_recompute=recompute,
    )  # fmt: skip
    compiled, _, _ = compile_lib.compile_train_step(config)
    return config, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    'block,sequence_parallel,recompute',
    [('llama', True, ''), ('gpt', False, ''), ('llama', True, 'qkv,attn_out')],
)
def test_selective_recompute_keeps_per_layer_what_the_plan_counts(
    block, sequence_parallel, recompute
):
    """What two more layers add to the step's temporaries under remat selective, less what
    they add under remat full (gradients, optimizer temporaries: the same in both), plus full's
    kept layer input: the bytes one layer keeps under selective recompute, within 10 % of
    arithmetic.layer_activation_bytes (Korthikanti's count, which it used, was 1.6 x and 2.3 x
    these); with model.remat_recompute, less what it names (the 405B's: docs/benchmarks.md)."""
    grown, configs = {}, {}
    for remat in ('selective', 'full'):
        names = recompute if remat == 'selective' else ''
        _, two = _temporaries(block, remat, 2, sequence_parallel, names)
        configs[remat], four = _temporaries(block, remat, 4, sequence_parallel, names)
        grown[remat] = (four - two) / 2
    rows, model = configs['selective'].train.micro_batch, configs['selective'].model
    full = arithmetic.layer_activation_bytes(model, rows, 4, 'full')
    measured = grown['selective'] - grown['full'] + full
    planned = arithmetic.layer_activation_bytes(model, rows, 4, 'selective')
    assert _close(measured, planned), (measured, planned)


def test_a_bf16_step_compiled_on_cpu_has_the_memory_of_its_fp32_twin():
    """What report.cpu_equivalent rests on, measured: the bf16 plan is smaller than the fp32
    plan, and the compiled bf16 step sits at the fp32 plan, not the bf16 one."""
    config, planned, compiled, _, _ = _planned_and_compiled('data_bf16')
    bf16_total = report.make_plan(config)['per_device_bytes']['total']
    assert bf16_total < 0.8 * planned['per_device_bytes']['total']
    assert compiled['peak_bytes'] > 1.2 * bf16_total


@pytest.mark.parametrize('name', ['tensor', 'pipelined'])
def test_planned_tensor_and_pipeline_bytes(name):
    """Megatron's all-reduces over 'tensor' (layers, embedding, head; in the 1F1B engine also
    each backward's recompute), the pipeline's hand-offs over 'stage' and ZeRO-1 of what
    every stage holds over 'data' and 'stage' together (the stages' shares of its gradients
    summed by the reduce-scatter): planned bytes per device per step within 10 % of the
    inventory, whose conditionals are weighted by the engine's table."""
    config, planned, compiled, _, _ = _planned_and_compiled(name)
    pairs = [('all-reduce', 'tensor')]
    if config.mesh.stage > 1:
        assert config.mesh.data > 1
        pairs += [('collective-permute', 'stage')]
        pairs += [('reduce-scatter', 'data+stage'), ('all-gather', 'data+stage')]
    for kind, axis in pairs:
        want = planned['comm_bytes_per_device'][kind][axis]
        got = compiled['comm_bytes_per_device'][kind][axis]
        assert _close(got, want), (kind, axis, got, want)


@pytest.mark.parametrize('name', ['tensor', 'data_bf16', 'pipelined'])
def test_planned_data_parallel_bytes(name):
    """ZeRO-1: one reduce-scatter of the fp32 gradients and one all-gather of the parameters
    over 'data' per step; everything the step sends over 'data' within 10 % of that."""
    _, planned, compiled, _, _ = _planned_and_compiled(name)
    want = sum(per_axis.get('data', 0.0) for per_axis in planned['comm_bytes_per_device'].values())
    got = sum(per_axis.get('data', 0.0) for per_axis in compiled['comm_bytes_per_device'].values())
    assert _close(got, want), (got, want)


def test_parameter_all_gather_over_data_is_planned(name='data_bf16'):
    """The part of the data-parallel plan today's code already meets: one all-gather of the
    compute copy per step (in fp32 on XLA:CPU), all but kilobytes of it outside any loop."""
    _, planned, compiled, _, _ = _planned_and_compiled(name)
    want = planned['comm_bytes_per_device']['all-gather']['data']
    assert _close(compiled['comm_bytes_per_device']['all-gather']['data'], want)
    gathers = [c for c in compiled['collectives'] if c['kind'] == 'all-gather']
    once = sum(c['wire_bytes'] for c in gathers if not c['in_loop'] and c['count'] == 1)
    assert once >= 0.95 * want


def test_compiled_matmul_flops_match_model_flops():
    """Matmul FLOPs of the compiled step, loop trip counts multiplied in, against 6 N + 12 L H
    Q T per token over the devices (no recompute): within 10 %."""
    _, _, compiled, _, _ = _planned_and_compiled('tensor')
    assert abs(compiled['flops_vs_model'] - 1.0) <= TOLERANCE


CUBLAS = """HloModule gemm, num_partitions=1

ENTRY %main (x: bf16[512,256], w: bf16[256,1024]) -> bf16[512,1024] {
  %x.1 = bf16[512,256]{1,0} parameter(0)
  %w.1 = bf16[256,1024]{1,0} parameter(1)
  %custom-call.1 = (bf16[512,1024]{1,0}, s8[4194304]{0}) custom-call(%x.1, %w.1), custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %get-tuple-element.1 = bf16[512,1024]{1,0} get-tuple-element(%custom-call.1), index=0
}
"""


def test_cublas_gemm_calls_count_as_matmuls():
    """XLA:GPU lowers a dot to a cuBLAS call when Triton GEMMs are off: the same FLOPs."""
    assert hlo_module.dot_flops(CUBLAS) == 2 * 512 * 1024 * 256


RAGGED = """HloModule ragged, num_partitions=1

ENTRY %main (x: bf16[512,256], w: bf16[8,256,1024], dy: bf16[512,1024], g: s32[8]) -> (bf16[512,1024], bf16[8,256,1024]) {
  %x = bf16[512,256]{1,0} parameter(0)
  %w = bf16[8,256,1024]{2,1,0} parameter(1)
  %dy = bf16[512,1024]{1,0} parameter(2)
  %g = s32[8]{0} parameter(3)
  %y = bf16[512,1024]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
  %dw = bf16[8,256,1024]{2,1,0} ragged-dot(%x, %dy, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}, lhs_ragged_dims={0}
  ROOT %out = (bf16[512,1024]{1,0}, bf16[8,256,1024]{2,1,0}) tuple(%y, %dw)
}
"""


def test_ragged_dots_count_the_rows_they_multiply():
    """A ragged dot (XLA's grouped matmul, as a TPU compile keeps it) counts each row once
    through its own group's weights, forward and weight gradient alike: not the 8 groups x
    a dense lowering runs."""
    assert hlo_module.dot_flops(RAGGED) == 2 * (2 * 512 * 256 * 1024)


def moe_step_config(**moe):
    """support.plan_config's tensor layout (data 2 x tensor 4) with Llama's block and, given
    `moe`, a mixture of SwiGLU experts (else the dense SwiGLU of 256)."""
    model = dict(support.LLAMA_BLOCK, ffn_hidden=256)
    if moe:
        model['moe'] = moe
    return support.small_config(
        **support.PLAN_LAYOUTS['tensor'], **model, remat='none', hidden=256, vocab_size=1500
    )


def _compiled_vs_hardware(config):
    """(the compiled step's matmul FLOPs over Megatron's count of its active weights, no
    recompute: 72 B s (l W / 12 + ...), the compiled FLOPs per step)."""
    compiled, _, info = compile_lib.compile_train_step(config)
    plan = report.add_compiled(report.make_plan(config), config, compiled, info)
    return plan['compiled']['flops_vs_hardware'], plan['compiled']['flops'] * 8


def test_compiled_moe_matmul_flops_match_the_active_count():
    """A mixture of experts' compiled step multiplies what its tokens' chosen experts do, not
    every expert: 8 SwiGLU experts of 128, top 2, against its dense twin (a SwiGLU of 256:
    the same active MLP weights, less the router). Each step's compiled matmul FLOPs over
    Megatron's count of its active weights; the MoE's within 10 % of the dense twin's (the
    twin's own excess, about 1.1 here, is the model's outside the layers: the embedding's
    lookup compiles as a matmul over the vocabulary shard), and well under a dense
    lowering's (every expert on every row: 4 x the routed part)."""
    moe, moe_flops = _compiled_vs_hardware(moe_step_config(experts=8, top_k=2, ffn_hidden=128))
    dense, dense_flops = _compiled_vs_hardware(moe_step_config())
    assert abs(moe / dense - 1.0) <= TOLERANCE
    routed = 3 * 256 * 128 * 2 * 2  # SwiGLU's 3 matrices, a token's 2 experts, 2 layers
    tokens = support.GLOBAL_BATCH * support.SEQ_LEN
    assert moe_flops - dense_flops < 6 * tokens * routed  # a dense lowering: 18 x tokens x routed


FUSED_CONDITION = """HloModule fused_condition

%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %bound = s32[] constant(127)
  ROOT %lt = pred[] compare(%p, %bound), direction=LT
}

%cond (t: (s32[], f32[4,8])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %go = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (t: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,8]{1,0} constant({...})
  %y = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
}

ENTRY %main (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %loop = (s32[], f32[4,8]{1,0}) while(%p), condition=%cond, body=%body
}
"""


def test_a_loops_bound_inside_a_fused_compare_is_its_trip_count():
    """XLA:GPU fuses a rotated micro-step loop's `i < 127` into a fusion its condition calls,
    with no known_trip_count (the Llama 3 8B step's 128 micro-steps): the bound is read from
    the fusion, and the body's dot counted 127 times, not once."""
    computations, entry = hlo_module.parse_module(FUSED_CONDITION)
    (loop,) = [i for i in computations[entry] if i.opcode == 'while']
    assert hlo_module.trip_count(loop, computations) == 127
    assert hlo_module.dot_flops(FUSED_CONDITION) == 127 * 2 * 4 * 8 * 8


def test_zero_bubble_taps_in_the_compiled_loop_are_the_plans():
    """ZB-V's tap buffers (parallel/taps.py) in the compiled tick loop, per device: tap slots x
    a chunk's layers x arithmetic.tap_bytes. Llama's block (Q and KV read one x, SwiGLU's in
    and gate another), tensor 2, sequence parallel, two pieces a sequence: the residual-stream
    taps held as their sequence shard, the others split by heads or MLP width."""
    config = support.small_config(
        1, 2, 2, 4, 2, 'zbv', num_layers=4, hidden=128, ffn_hidden=384, remat='full',
        sequence_parallel=True, sequence_pieces=2, **support.LLAMA_BLOCK,
    )  # fmt: skip
    compiled, _, _ = compile_lib.compile_train_step(config)
    table = pipeline.build_table(2, 2, 4, schedule='zbv')
    assert table.tap_slots != table.resid_slots  # a tap buffer's leading axes are its own
    computations, _ = hlo_module.parse_module(compiled.as_text())
    loops = [i.type_text for c in computations.values() for i in c if i.opcode == 'while']
    taps = [
        [(dtype, dims) for dtype, dims in hlo_module.ARRAY.findall(state) if dims.count(',') >= 4]
        for state in loops
    ]
    tapped = max(
        ([(d, s) for d, s in state if s.startswith(f'{table.tap_slots},1,')] for state in taps),
        key=len,
    )
    assert len(tapped) == 2 * 10  # two pieces: Q, attention-out, gate, MLP-out (x, dy); KV, in
    held = sum(hlo_module.shape_bytes(f'{d}[{s}]') for d, s in tapped)
    rows = config.train.micro_batch
    assert held == table.tap_slots * arithmetic.tap_bytes(config.model, rows, config.mesh.tensor)
