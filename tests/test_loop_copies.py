"""No large copy inside the train step's loops, read from the XLA:GPU compile (compile-only
A100s, plan/gpu_target.py) with the plan's own reader (plan/loop_copies.py). A copy of the
pipeline's fp32 accumulators or stashes inside its scan runs every tick: on the 530 B layout
terabytes a step. Skipped without the gpu-compile compiler (make gpu-compile)."""

import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.xla import gpu_compile
from mtnlg_jax.parallel import branches
from mtnlg_jax.plan import gpu_target, hlo, hlo_module
from mtnlg_jax.plan.loop_copies import loop_copies

pytestmark = pytest.mark.skipif(
    gpu_compile.missing() is not None, reason=str(gpu_compile.missing())
)
MIB = 1 << 20
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'collective-permute', 'all-to-all')


def test_no_copy_over_a_mib_inside_the_loops_of_gpipe():
    """Hidden 512, fp32: a layer's accumulators are 12 MiB. (Interleaved 1F1B in bf16:
    test_gpu_compile.py reads its flash kernel's compile for copies; 1F1B: the Llama case.)"""
    config = support.small_config(
        stage=2, repeats=2, schedule='gpipe', micro_steps=4, num_layers=4,
        hidden=512, compute_dtype='float32', remat='selective',
    )  # fmt: skip
    assert_no_copy_in_a_loop(config)


def test_no_copy_inside_a_loop_of_a_llama_with_stages_of_unequal_depth():
    """The 405 B recipe in small: Llama's block (SwiGLU: gate and up of one shape), 1F1B over
    stages of 3, 4 and 3 layers (padding slots), full recompute. An idle backward that returned
    a zero gradient wrote one of the chunk's size (two leaves of one shape share a broadcast,
    copied into the second), and a padding slot wrote zero residuals for its layer's backward."""
    config = support.small_config(
        micro_steps=4, num_layers=10, hidden=512, compute_dtype='bfloat16', remat='full',
        **support.LLAMA_BLOCK,
    )  # fmt: skip
    config = config_lib.inputs_of(config)
    config.mesh.stage = 3
    config.pipeline.update(first_stage_layers=3, last_stage_layers=3)
    config = config_lib.resolve(config, 3)
    text = assert_no_copy_in_a_loop(config)
    computations, _ = hlo_module.parse_module(text)
    idle = branches_of(computations, f'{branches.BACKWARD}/cond', 'true_computation')
    assert idle
    written = {
        hlo_module.ARRAY.match(i.type_text).group(2)
        for name in idle
        for i in computations[name]
        if i.opcode not in ('parameter', 'get-tuple-element', 'tuple')
        and hlo_module.shape_bytes(i.type_text) >= MIB
    }
    # the block accumulators handed through; written: only the zero gradients of the input
    # and output embeddings (the shared parameters' add is skipped)
    assert written <= {f'{config.model.padded_vocab},{config.model.hidden}'}, written


def test_no_copy_over_a_mib_inside_the_loops_of_zbh1():
    """ZB-H1's B and W slots (zero_bubble.py): W reads the residuals and gradient B read, in
    later ticks, and adds to the accumulators; B touches no accumulator. Hidden 512, fp32."""
    config = support.small_config(
        stage=2, schedule='zbh1', micro_steps=4, num_layers=4, hidden=512,
        compute_dtype='float32', remat='selective',
    )  # fmt: skip
    assert_no_copy_in_a_loop(config)


def test_no_copy_over_a_mib_inside_the_loops_of_the_steady_tick():
    """pipeline.steady_tick (interleaved, the big configs' schedule): one switch over the
    tick's slot pairs returns both slots' results, written and added outside it, in place;
    with pipeline.fused_accumulation, no fp32 add of a kernel's size beside the GEMMs.
    Hidden 512, fp32."""
    config = support.small_config(
        stage=2, repeats=2, schedule='interleaved', micro_steps=4, num_layers=4, hidden=512,
        compute_dtype='float32', remat='selective',
    )  # fmt: skip
    config.pipeline.steady_tick = True
    config.pipeline.fused_accumulation = True
    text = assert_no_copy_in_a_loop(config)
    assert_accumulation_in_the_gemms(hlo_module.parse_module(text)[0])


def test_each_chunks_backward_adds_its_weight_gradients_beside_its_reduce_scatters():
    """The 530 B's engine in small (interleaved by slot, bf16, sequence parallel, selective
    recompute, pipeline.fused_accumulation): each chunk's backward runs in a conditional of
    its own (parallel/chained.py) whose branch contracts its taps into the chunk's fp32
    accumulators in the dW GEMMs (the add their epilogue) in the computation that runs the
    dgrad GEMMs and their tensor reduce-scatters, so XLA:GPU's scheduler may hide one under
    the other (the 530 B's reduce-scatters 3 % overlapped while the dW GEMMs ran in the
    accumulators' conditionals; docs/benchmarks.md). Only QKV's taps (its x and dy: its dW
    is deferred) leave a chunk's conditional (no other array with a layer
    axis in the compute dtype), for the accumulators' conditionals, which hold no collective
    (the stage hand-offs run beside them); a skipped link hands everything through, copying
    nothing (each kernel's accumulator here is 128 to 512 KiB) and writing no zero taps."""
    config = support.small_config(
        stage=2, tensor=2, repeats=2, schedule='interleaved', micro_steps=4, num_layers=4,
        hidden=256, compute_dtype='bfloat16', remat='selective', sequence_parallel=True,
    )  # fmt: skip
    config.pipeline.fused_accumulation = True
    text = assert_no_copy_in_a_loop(config, min_bytes=64 << 10)
    computations, _ = hlo_module.parse_module(text)
    scope = f'{branches.BACKWARD_CHUNK}/cond'
    handed_out = [taps_of(i.type_text) for i in conditionals(computations, scope)]
    assert handed_out and max(map(len, handed_out)) == 2, handed_out  # QKV's x and dy
    shapes = {shape for taps in handed_out for shape in taps}
    written = [
        i.type_text
        for name in branches_of(computations, scope, 'true_computation')
        for i in computations[name]
        if i.opcode not in ('parameter', 'get-tuple-element', 'tuple')
        and taps_of(i.type_text) & shapes
    ]
    assert not written, written  # a skipped link hands on the last tick's taps, no zeros
    accumulators = reachable(computations, branches_of(computations, f'{branches.ACCUMULATE}/cond'))
    held = [i.opcode for name in accumulators for i in computations[name] if collective(i)]
    assert accumulators and not held, held
    beside = [
        name
        for name in reachable(computations, branches_of(computations, scope))
        if any(i.opcode.startswith('reduce-scatter') for i in computations[name])
        and sum(accumulating(computations, i) for i in computations[name]) >= 3
    ]  # every site's dW but QKV's
    assert beside
    assert_accumulation_in_the_gemms(computations, branches.BACKWARD_CHUNK, gemms=3)


def taps_of(type_text):
    """The shapes in an HLO type that could be taps: bf16 with a layer axis, (layers, rows,
    seq, ...)."""
    arrays = hlo_module.ARRAY.findall(type_text)
    return {f'bf16[{dims}]' for dtype, dims in arrays if dtype == 'bf16' and dims.count(',') >= 3}


def collective(instruction):
    return instruction.opcode.startswith(COLLECTIVES)


def reachable(computations, names):
    """The computations `names` run, themselves included (through conditionals and loops)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [c for i in computations[name] for a, c in i.callees() if a != 'calls']
    return seen


def accumulating(computations, instruction):
    """Whether `instruction` is a dW GEMM with its accumulator added in its epilogue: a GEMM
    fusion whose computation adds in fp32."""
    callee = dict(instruction.callees()).get('calls')
    return bool(
        instruction.opcode == 'fusion'
        and '_gemm' in instruction.rest
        and any(i.opcode == 'add' and i.type_text.startswith('f32') for i in computations[callee])
    )


def branches_of(computations, scope, which=None):
    """The branch computations (`which`: 'true_computation' etc., None: every one) of the
    conditionals whose op name ends with `scope`."""
    return [
        callee
        for i in conditionals(computations, scope)
        for attr, callee in i.callees()
        if which in (None, attr)
    ]


def conditionals(computations, scope):
    """The conditionals whose op name ends with `scope`."""
    return [
        i
        for instructions in computations.values()
        for i in instructions
        if i.opcode == 'conditional' and i.op_name().endswith(scope)
    ]


def assert_accumulation_in_the_gemms(computations, scope=branches.ACCUMULATE, gemms=4):
    """The chunks' accumulators take each kernel's gradient in its dW GEMM (the accumulator
    its operand, the add its epilogue: Stage.fused), not by an fp32 add of the kernel's size
    (the 530 B's 2.3 s of adds, docs/benchmarks.md): in `scope` at least `gemms` such GEMMs, and no
    other fusion writes an fp32 array of an accumulating GEMM's shape."""
    written = [
        i
        for instructions in computations.values()
        for i in instructions
        if i.opcode in ('fusion', 'custom-call') and f'{scope}/' in i.op_name()
    ]  # ACCUMULATE/: not the shared parameters' (ACCUMULATE_SHARED)
    gemm = [i for i in written if accumulating(computations, i)]
    shapes = {i.type_text.split('{')[0] for i in gemm}
    added = [i.type_text for i in written if i not in gemm and i.type_text.split('{')[0] in shapes]
    assert len(gemm) >= gemms and not added, (len(gemm), added)


def assert_no_copy_in_a_loop(config, min_bytes=MIB):
    """The step's HLO text, after checking it copies no buffer of min_bytes or more in a loop
    (a zero fill copied from a broadcast is a write, not a copy: plan/loop_copies.py)."""
    compiled, _ = gpu_target.compile_train_step(config, 'a100-80gb')
    text = compiled.as_text()
    copies = loop_copies(text, min_bytes=min_bytes)
    assert not copies, [(c['type'], c['computation']) for c in copies]
    return text


def test_overlap_grad_reduce_scatters_a_finished_chunk_beside_a_backwards_matmuls():
    """pipeline.overlap_grad_reduce (parallel/grad_reduce.py), interleaved over data 2 x
    stage 2 x tensor 2: the fp32 reduce-scatter over 'data' of a finished chunk's layer runs
    in the loop, in the computation of another chunk's backward (its switch's branch), its
    start before and its done after that backward's matmuls (or the loop over its layers that
    runs them), so XLA:GPU's scheduler has them to hide it behind; no copy of a MiB in the
    loop. With pipeline.overlap_param_gather, the mirror: chunk 1's all-gather over 'data'
    runs in the first ticks' loop, in chunk 0's forward branch (gathering_tick.py), around
    its matmuls. Hidden 512, fp32."""
    config = support.small_config(
        data=2, stage=2, tensor=2, repeats=2, schedule='interleaved', micro_steps=4,
        num_layers=4, hidden=512, compute_dtype='float32', remat='selective',
    )  # fmt: skip
    config.pipeline.update(overlap_grad_reduce=True, overlap_param_gather=True)
    text = assert_no_copy_in_a_loop(config)
    computations, _ = hlo_module.parse_module(text)
    inventory = hlo.collective_inventory(text, dict(data=2, stage=2, tensor=2))
    for kind, scope in (('reduce-scatter', branches.REDUCE), ('all-gather', branches.GATHER)):
        ops = [op for op in inventory if op['kind'] == kind and op['axes'] == ('data',)]
        looped = [op for op in ops if op['in_loop']]
        variants = set(branches_of(computations, f'{scope}/cond'))
        assert looped and all(op['computation'] in variants for op in looped), ops
        for op in looped:
            body = computations[op['computation']]
            names = [i.name for i in body]
            start = names.index(op['name'])
            done = next(k for k, i in enumerate(body) if op['name'] in i.rest and k > start)
            assert any(runs_gemm(computations, i) for i in body[start:done]), names[start:done]


def runs_gemm(computations, instruction):
    """Whether `instruction` is a GEMM, or a loop or conditional whose computations run one."""
    callees = [c for a, c in instruction.callees() if a != 'calls']
    inside = [i for name in reachable(computations, callees) for i in computations[name]]
    return any(
        (i.opcode == 'fusion' and '_gemm' in i.rest)
        or (i.opcode == 'custom-call' and 'gemm' in i.rest)
        for i in [instruction, *inside]
    )
