"""XLA:GPU as the measuring instrument: steps compiled for compile-only A100s on this CPU machine
(plan/gpu_target.py), read by the planner's tools. Skipped, with what to install, without the
gpu-compile compiler (make gpu-compile)."""

import contextlib
import functools
import io
import json
import os
import re
import pathlib
import subprocess
import sys
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import support
from mtnlg_jax.xla import gpu_compile
from mtnlg_jax.parallel import taps
from mtnlg_jax.plan import arithmetic, clusters, gpu_target, overlap, report
from mtnlg_jax.plan.loop_copies import loop_copies

pytestmark = pytest.mark.skipif(
    gpu_compile.missing() is not None, reason=str(gpu_compile.missing())
)
TARGET = 'a100-80gb'
TOLERANCE = 0.10
MIB = 1 << 20


def _gpu_plan(config, compiled=None, info=None):
    """The plan of a resolved config with its train step compiled for TARGET (or as given)."""
    if compiled is None:
        compiled, info = gpu_target.compile_train_step(config, TARGET)
    plan = report.make_plan(config, TARGET)
    return report.add_compiled(plan, config, compiled, info, target=TARGET)


# What the plan does not yet count as XLA:GPU compiles the 1F1B engine's collectives (memory
# matches, and the CPU compile's all-reduces): strict, so the day it matches, this must go.
PIPELINED_GAP = pytest.param(
    'pipelined',
    marks=pytest.mark.xfail(
        strict=True,
        reason='1F1B engine under XLA:GPU: XLA keeps the stashed residuals split over tensor '
        'along the sequence and gathers them (all-gathers over tensor 4.6 x the plan, '
        'all-reduces 0.63 x, reduce-scatters it chose itself)',
    ),
)
LAYOUTS = ['tensor', 'data_bf16', PIPELINED_GAP]


# configs/tiny.py's layout (data 2 x stage 2 x tensor 2, interleaved 1F1B) made, on the command
# line, support.plan_config('pipelined'): the plan tests' pipelined layout, compiled once for
# both (each XLA:GPU compile of this pipeline takes a minute on 2 cores).
TINY_AS_PIPELINED = [
    '--config.model.remat=none',
    '--config.model.seq_len=32',
    '--config.model.vocab_size=1500',
    '--config.data.tokenizer=',  # none: tiny's own (8192 pieces) is larger than 1500
    '--config.train.micro_batch=2',
    '--config.train.rampup.start=0',
    '--config.train.seed=3',
    '--config.train.steps=10',
    '--config.optimizer.lr=0.003',
    '--config.optimizer.min_lr=0.0003',
    '--config.optimizer.warmup_tokens=1024',
    '--config.optimizer.decay_tokens=5120',
]


# support.plan_config('tensor') made the same way (data 2 x tensor 4, 2 layers, no pipeline):
# the cheapest layout to compile twice for --pgle.
TINY_AS_TENSOR = [
    *TINY_AS_PIPELINED,
    '--config.mesh.stage=1',
    '--config.mesh.tensor=4',
    '--config.pipeline.repeats=1',
    '--config.model.num_layers=2',
    '--config.train.micro_batch=4',
]


@functools.lru_cache(maxsize=None)
def plan_at_the_command_line():
    """`launch/plan.py --config configs/tiny.py [TINY_AS_PIPELINED] --target a100-80gb --json`
    as a user runs it: (its result, the plan its JSON holds)."""
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / 'plan.json'
        command = [sys.executable, str(support.ROOT / 'launch/plan.py'), '--config',
                   'configs/tiny.py', *TINY_AS_PIPELINED, '--target', TARGET,
                   '--json', str(out)]  # fmt: skip
        result = subprocess.run(
            ['timeout', '-k', '10', '280', *command],
            capture_output=True, text=True, cwd=support.ROOT, env=support.TRAIN_ENV,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return result, json.loads(out.read_text())


@functools.lru_cache(maxsize=None)
def pgle_plan():
    """`launch/plan.py --config configs/tiny.py [TINY_AS_TENSOR] --target a100-80gb --json
    --pgle`, its main(argv) in this process (no second JAX start-up): (what it printed, the
    plan its JSON holds, the instruction names of the latency profile its first compile
    wrote: plan/pgle.py)."""
    plan_tool = support.launch_module('plan')
    printed = io.StringIO()
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / 'plan.json'
        args = ['--config', str(support.ROOT / 'configs/tiny.py'), *TINY_AS_TENSOR,
                '--target', TARGET, '--json', str(out), '--pgle']  # fmt: skip
        # the environment the tool sets before JAX starts (XLA_FLAGS) put back afterwards
        with mock.patch.dict(os.environ), contextlib.redirect_stdout(printed):
            with contextlib.redirect_stderr(printed):
                status = plan_tool.main(args)
        assert not status, printed.getvalue()[-2000:]
        profile = pathlib.Path(f'{out}.pgle.pbtxt').read_text()
        names = set(re.findall(r'costs \{ name: "([^"]+)" cost_us: [0-9.]+ \}', profile))
        assert len(names) == len(profile.splitlines()), profile[:500]
        return printed.getvalue(), json.loads(out.read_text()), names


@functools.lru_cache(maxsize=None)
def gpu_plan(name):
    if name == 'pipelined':  # the command line's compile of the same config
        return plan_at_the_command_line()[1]
    return _gpu_plan(support.plan_config(name))


def test_plan_target_compiles_the_tiny_config_for_a100s():
    """`launch/plan.py --target a100-80gb` as a user runs it: configs/tiny.py's layout (data 2
    x stage 2 x tensor 2, interleaved 1F1B) on 8 compile-only A100s, its overrides those of
    support.plan_config('pipelined') (the plan, compile aside, is that config's); the JSON has
    XLA:GPU's memory, matmul FLOPs, attention kernels and the overlap table, the printout its
    rows (--pgle: the next test)."""
    result, plan = plan_at_the_command_line()
    compiled = plan['compiled']
    # the plan's figures, its config included, are plan_config's ('cluster': its prediction,
    # which the compile's overlap table updates)
    in_process = json.loads(json.dumps(report.make_plan(support.plan_config('pipelined'), TARGET)))
    for key in (set(plan) | set(in_process)) - {'compiled', 'cluster'}:
        assert plan.get(key) == in_process.get(key), key
    assert compiled['platform'] == 'cuda' and compiled['target'] == TARGET
    assert compiled['devices'] == 8
    assert compiled['temp_bytes'] > 0 and compiled['peak_bytes'] > compiled['argument_bytes']
    # no recompute: the model's matmul FLOPs, within 2 % (0.994 at 72a009c; full recompute's
    # second forward: test_pipeline_flops.py's 1f1b-full case, compiled by XLA:CPU)
    assert compiled['flops_vs_model'] == pytest.approx(1.0, abs=0.02)
    assert compiled['attention']['fused'] == bool(compiled['attention']['kernels'])
    table = compiled['overlap']['table']
    kinds = {(row['kind'], row['axes'], row['link']) for row in table}
    assert ('collective-permute', 'stage', 'nvlink') in kinds
    assert all(0.0 <= row['overlapped'] <= 1.0 for row in table)
    assert compiled['overlap']['step_s'] >= compiled['overlap']['compute_s'] > 0
    # each tick at its slowest stage: every slot priced alone averages to the replay's tick
    # (the per-slot weights are the mean's parts, but for nested conditionals' shares taken
    # of their enclosing branch: 0.09 % apart here), and the ramps' idle slots add a bubble
    ticks = compiled['overlap']['lockstep']
    assert ticks['ticks'] == arithmetic.engine_table(support.plan_config('pipelined')).ticks
    assert ticks['slots_mean_tick_s'] == pytest.approx(ticks['mean_tick_s'], rel=0.01)
    assert ticks['bubble_s'] > 0.1 * ticks['lockstep_loop_s']
    assert 'ticks at its slowest stage' in result.stdout
    assert 'compile-only a100-80gb GPUs (XLA:GPU)' in result.stdout
    assert 'collective-permute stage' in result.stdout and 'overlapped' in result.stdout
    assert 'autotuning was skipped' in result.stdout


def test_plan_pgle_compiles_again_with_the_replayed_costs_as_the_latency_profile():
    """`launch/plan.py --target a100-80gb --pgle` on support.plan_config('tensor') made at the
    command line (its plan, config included, that config's): compiled a second time with the
    first compile's replayed costs as XLA's latency profile, whose rows parse one by one; the
    second compile's collectives are the first's by name, so XLA's scheduler finds each one's
    replayed cost in the profile."""
    printed, plan, profiled = pgle_plan()
    in_process = json.loads(json.dumps(report.make_plan(support.plan_config('tensor'), TARGET)))
    for key in (set(plan) | set(in_process)) - {'compiled', 'cluster'}:
        assert plan.get(key) == in_process.get(key), key
    collectives = {op['name'] for op in plan['compiled']['collectives']}
    assert collectives and collectives <= profiled
    assert 'compiled again with the first compile\'s replayed costs' in printed


@pytest.mark.parametrize('name', list(support.PLAN_LAYOUTS))
def test_planned_memory_per_device_against_the_gpu_compile(name):
    """The plan of the step as configured, under selective recompute (bf16 as bf16: no fp32
    twin, as on XLA:CPU) against XLA:GPU's arguments + unaliased outputs + temporaries."""
    plan = _gpu_plan(support.plan_config(name, remat='selective'))
    planned, compiled = plan['per_device_bytes']['total'], plan['compiled']['peak_bytes']
    assert abs(compiled - planned) <= TOLERANCE * planned, (compiled, planned)


@pytest.mark.parametrize('name', LAYOUTS)
def test_planned_collective_bytes_against_the_gpu_compile(name):
    """Every (kind, axis) the plan names, within 10 % of the GPU compile's inventory; the
    ZeRO-1 gradient sum is a reduce-scatter (XLA:CPU makes it an all-reduce + slice) and the
    bf16 step's parameter all-gather moves bf16."""
    plan = gpu_plan(name)
    compiled = plan['compiled']['comm_bytes_per_device']
    for kind, per_axis in plan['comm_bytes_per_device'].items():
        for axis, want in per_axis.items():
            got = compiled.get(kind, {}).get(axis, 0.0)
            assert abs(got - want) <= TOLERANCE * want, (kind, axis, got, want)
    assert compiled.get('all-reduce', {}).get('data', 0.0) < 1024  # a few scalars


@functools.lru_cache(maxsize=None)
def flash_plan():
    """The pipelined layout (data 2 x stage 2 x tensor 2, interleaved 1F1B, 4 micro-batches) in
    bf16 with attention dropout and selective recompute, hidden 256 (head dim 32): (the plan's
    compiled section, the HLO text)."""
    config = support.small_config(
        **support.PLAN_LAYOUTS['pipelined'], hidden=256, vocab_size=1500,
        compute_dtype='bfloat16', attention_dropout=0.1, remat='selective',
    )  # fmt: skip
    compiled, info = gpu_target.compile_train_step(config, TARGET)
    return _gpu_plan(config, compiled, info)['compiled'], compiled.as_text()


def test_the_flash_kernel_compiles_inside_the_pipeline():
    """On A100s with attention dropout, 'auto' takes the Pallas flash kernel as Triton, forward
    and backward kernels inside the engine's loop; the compiled FLOPs count them (dense, as 6N +
    12LHQT does: the ratio stays that of the plain path, whose einsums it replaces). cuDNN's
    kernels in the same layout: the Llama test below."""
    plain = gpu_plan('pipelined')['compiled']  # the same layout in fp32: plain attention
    compiled, _ = flash_plan()
    assert compiled['attention']['fused']
    assert set(compiled['attention']['kernels']) == {
        'flash_attention_forward',
        'flash_attention_dkv',
        'flash_attention_dq',
    }
    # the backward kernels recompute the scores: 7 matmuls of the scores' size where the
    # plain path runs 6; everything else is the same work (selective recompute reruns nothing
    # of the kernel's: the next test)
    assert compiled['flops_vs_model'] >= plain['flops_vs_model']
    assert compiled['flops_vs_model'] == pytest.approx(plain['flops_vs_model'], rel=0.05)


def test_selective_recompute_does_not_run_the_flash_forward_again():
    """model.remat=selective keeps the flash kernel's out and log-sum-exp (by name), so the
    train step runs the forward kernel once for each backward (before: once more per backward,
    the forward rerun to get the log-sum-exp back), in every chunk of the interleaved pipeline:
    the residuals the engine stashes are the policy's."""
    kernels = flash_plan()[0]['attention']['kernels']
    assert kernels['flash_attention_forward'] == kernels['flash_attention_dq'] > 0


def test_no_copy_over_a_quarter_mib_inside_the_interleaved_bf16_pipelines_loops():
    """The same compile read for copies in loops (tests/test_loop_copies.py: GPipe and the
    Llama 1F1B recipe): a stage's fp32 accumulators here are 0.75 to 1 MiB a weight on each
    device, its bf16 weights half that; before the accumulators were updated in place (at
    df46e8f^), the backward's conditionals copied 18 buffers of 0.25 MiB or more every tick."""
    copies = loop_copies(flash_plan()[1], min_bytes=MIB // 4)
    assert not copies, [(c['type'], c['computation']) for c in copies]


def _overlap_of(step, mesh, x, w):
    compiled = jax.jit(step).lower(x, w).compile()
    target = overlap.Target.of_cluster(clusters.CLUSTERS[TARGET], 'bfloat16')
    result = overlap.collective_overlap(compiled.as_text(), mesh, target)
    (gather,) = [row for row in result['collectives'] if row['kind'] == 'all-gather']
    return gather


def test_overlap_of_a_compiled_step_with_and_without_independent_work():
    """An all-gather over a node's 4 GPUs (24 MB sent by each: 80 us on NVLink) beside an
    independent 137 GFLOP matmul (0.44 ms at peak) is hidden whole by the latency-hiding
    scheduler; one whose result the matmul needs is exposed whole."""
    mesh = Mesh(
        np.array(gpu_target.devices(TARGET, 8)).reshape(2, 4),
        ('data', 'tensor'),
        axis_types=(AxisType.Auto,) * 2,
    )
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P('tensor')))
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    gather = jax.shard_map(
        lambda a: jax.lax.all_gather(a, 'tensor', tiled=True),
        mesh=mesh,
        in_specs=P('tensor'),
        out_specs=P(),
        check_vma=False,
    )

    def beside(x, w):
        return gather(x), w @ w

    def after(x, w):
        return gather(x) @ w

    hidden = _overlap_of(beside, mesh, x, w)
    exposed = _overlap_of(after, mesh, x, w)
    for row in (hidden, exposed):
        assert row['link'] == 'nvlink' and row['axes'] == ['tensor']
        assert row['wire_s'] == pytest.approx(3 / 4 * 4096 * 4096 * 2 / 300e9)
    assert hidden['exposed_s'] == pytest.approx(0.0, abs=1e-9)
    assert exposed['exposed_s'] == pytest.approx(exposed['wire_s'])


def test_a_llama_block_compiles_with_grouped_cudnn_attention_inside_the_pipeline():
    """Llama's block (rope, RMSNorm, SwiGLU, 8 query heads over 4 key/value heads, untied) in
    bf16 on the pipelined layout: cuDNN's flash attention takes the grouped keys and values
    (2 key/value heads a tensor rank) forward and backward, and the compiled matmul FLOPs are
    the model FLOPs the planner counts for GQA and SwiGLU (6N + 12LHQT) but for the untied
    input embedding, a gather that N counts as a matmul (6 V h a token: a tenth of this small
    model's FLOPs, 0.5 % of Llama 3 405B's), give or take the flash backward's recomputed
    scores. Under selective recompute the backward does not run cuDNN's forward again (its
    output and softmax statistics kept: gpt.remat_policy): as many forward calls as
    backward ones in the HLO (12 forward against 8 when it did; Qwen3-235B-A22B's compiled
    FLOPs 1.11 -> 1.04 x model: docs/benchmarks.md)."""
    config = support.small_config(
        **support.PLAN_LAYOUTS['pipelined'], hidden=256, vocab_size=1500,
        compute_dtype='bfloat16', remat='selective', **support.LLAMA_BLOCK,
    )  # fmt: skip
    compiled = _gpu_plan(config)['compiled']
    assert compiled['attention']['fused']
    kernels = compiled['attention']['kernels']
    assert set(kernels) == {'__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'}
    assert kernels['__cudnn$fmhaSoftmax'] == kernels['__cudnn$fmhaSoftmaxBackward'], kernels
    model = arithmetic.model_flops_per_step(config)
    tokens = config.train.global_batch * config.model.seq_len
    gather = 6 * config.model.padded_vocab * config.model.hidden * tokens
    ratio = compiled['flops_vs_model'] * model / (model - gather)
    assert 1.0 <= ratio < 1.05, (ratio, compiled['flops_vs_model'])


def test_packed_documents_compile_to_the_flash_kernel_with_no_sequence_square():
    """data.reset_attention_mask where 'auto' would run cuDNN (bf16, head dim 32, on the
    tensor layout): the Pallas flash kernel takes the segment ids, forward and backward, and
    no (rows, 1, seq, seq) array is left in the step (before: cuDNN was handed that mask and
    XLA:GPU compiled unfused attention around 50 of them)."""
    config = support.small_config(
        **support.PLAN_LAYOUTS['tensor'], hidden=256, vocab_size=1500, compute_dtype='bfloat16'
    )
    config.data.update(dict(reset_attention_mask=True, eod_id=3))
    compiled, info = gpu_target.compile_train_step(config, TARGET)
    kernels = _gpu_plan(config, compiled, info)['compiled']['attention']['kernels']
    assert set(kernels) == {'flash_attention_forward', 'flash_attention_dkv', 'flash_attention_dq'}
    seq = config.model.seq_len
    assert not re.findall(rf'\[\d+,1,{seq},{seq}\]', compiled.as_text())


def test_the_530b_attention_out_weight_gradient_compiles_for_h100s():
    """The fused accumulation's dW GEMM (taps.weight_grads into its fp32 accumulator) at MT-NLG
    530 B's per-device attention-out shape on an H100: 16 heads x head_dim 160 x hidden 20480,
    its x as the flash kernel leaves it (heads outermost). As the GEMM's left-hand side XLA:GPU
    fused x's transpose and found no tile (its untuned 64 rows for a GEMM this size do not
    divide 160: "Couldn't find output tile sizes", docs/benchmarks.md); as the right-hand side
    (taps._contract) it writes x contiguous first."""
    (device,) = gpu_target.devices('h100-80gb', 1)
    on = jax.sharding.SingleDeviceSharding(device)
    heads, head_dim, hidden, tokens = 16, 160, 20480, 256

    def accumulate(acc, x, dy):
        x = jnp.transpose(x, (1, 2, 3, 0, 4))  # (heads, l, b, q, d) -> (l, b, q, heads, d)
        return acc + taps._contract('lbqhd', x, 'lbqe', dy, 'lhde')

    shapes = [
        ((1, heads, head_dim, hidden), jnp.float32),
        ((heads, 1, 1, tokens, head_dim), jnp.bfloat16),
        ((1, 1, tokens, hidden), jnp.bfloat16),
    ]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on) for shape, dtype in shapes]
    text = jax.jit(accumulate, donate_argnums=0).lower(*args).compile().as_text()
    gemms = re.findall(r'%gemm_fusion\S* = (f32\[[\d,]+\])', text)
    assert gemms == ['f32[20480,2560]'], gemms  # one GEMM, x its right-hand side


def test_an_h200_compiles_as_an_h100_with_the_h200s_memory():
    """--target h200-141gb: the H100's description (the same chip) with the H200's memory
    bandwidth and size; a step compiles for it and is priced on the H200's figures."""
    fields = [
        dict(re.findall(r'^  (\w+): (\S+)$', gpu_target.target_config(name), re.M))
        for name in ('h100-80gb', 'h200-141gb')
    ]
    differ = {key for key in fields[0] if fields[0][key] != fields[1].get(key)}
    assert differ == {'memory_bandwidth', 'device_memory_size'}
    assert float(fields[1]['memory_bandwidth']) == clusters.CLUSTERS['h200-141gb'].hbm_bandwidth
    config = support.plan_config('tensor', remat='selective')
    compiled, info = gpu_target.compile_train_step(config, 'h200-141gb')
    plan = report.add_compiled(
        report.make_plan(config, 'h200-141gb'), config, compiled, info, target='h200-141gb'
    )
    assert plan['compiled']['target'] == 'h200-141gb' and plan['cluster']['fits']
    assert plan['cluster']['hbm_bytes'] == clusters.CLUSTERS['h200-141gb'].hbm_bytes
