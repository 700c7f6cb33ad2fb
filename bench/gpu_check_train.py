"""bench/gpu_check.py's training sections: a ~2 B GPT's train step on one GPU, its memory,
its compiled HLO and a profiler trace split by kind.

The step is compiled once per attention choice and kept (STEPS) so that memory, hlo and
profile read the step train_step timed.
"""

import collections
import pathlib
import re
import statistics

import jax
import numpy as np
from common import CompiledStep
from flax import nnx

from mtnlg_jax import config as config_lib
from mtnlg_jax.model import counts, gpt
from mtnlg_jax.plan import hlo_module, overlap, predict, report
from mtnlg_jax.plan.clusters import CLUSTERS
from mtnlg_jax.train import profile as profile_lib
from mtnlg_jax.xla.devices import device_peak_tflops

MIB = 2**20
STEPS = {}  # attention choice -> CompiledStep
# A ~2 B GPT with MT-NLG's head dimension: 24 layers of hidden 2560 = 16 heads x 160.
MODEL = dict(num_layers=24, hidden=2560, heads=16, seq_len=2048, vocab_size=50257,
             compute_dtype='bfloat16', remat='selective', hidden_dropout=0.1)  # fmt: skip
BATCH = dict(global_batch=16, micro_batch=4)


def config_of(attention='flash', attention_dropout=0.1, **model):
    """The check's config on one device: MODEL with these overrides."""
    config = config_lib.defaults()
    config.mesh.update(dict(data=1, stage=1, tensor=1))
    config.model.update({**MODEL, **model, 'attention': attention,
                         'attention_dropout': attention_dropout})  # fmt: skip
    config.train.update(BATCH)
    config.train.rampup.start = 0
    return config_lib.resolve(config, 1)


def _step(attention, dropout):
    key = (attention, dropout)
    if key not in STEPS:
        for other in list(STEPS):  # one state in memory at a time
            del STEPS[other]
        STEPS[key] = CompiledStep(config_of(attention, dropout))
    return STEPS[key]


def _throughput(step, steps=5):
    config = step.config
    seconds = statistics.median(step.step_times(steps, warmup=2))
    tokens = config.train.global_batch * config.model.seq_len
    params = counts.count_params(step.setup.abstract_state['params'])
    model_tflops = counts.model_flops_per_token(config.model, params) * tokens / seconds / 1e12
    peak = device_peak_tflops(jax.devices()[0], config.model.compute_dtype)
    target = _target()  # the plan's prediction of the same step on this GPU's cluster
    predicted = target and predict.step_time(config, CLUSTERS[target])['predicted_step_s']
    return dict(
        params=params,
        compile_s=round(step.compile_s, 1),
        step_s=round(seconds, 4),
        tokens_per_s=round(tokens / seconds),
        model_tflops=round(model_tflops, 1),
        mfu=round(model_tflops / peak, 4) if peak else None,
        predicted_step_s=predicted and round(predicted, 4),
        measured_vs_predicted=predicted and round(seconds / predicted, 3),
    )


def _losses(params, mesh, tokens, kinds=('flash', 'fused', 'plain')):
    """The loss of one batch under each attention choice at dropout 0, same parameters."""
    device = jax.devices()[0]
    out = {}
    for attention in kinds:
        try:
            cfg = config_of(attention, 0.0).model
            graphdef, _, _ = gpt.split(nnx.eval_shape(lambda c=cfg: gpt.create(c, 0, device)))

            def loss(p, batch, g=graphdef):
                total, count = gpt.loss_sum(gpt.merge(g, p), batch)
                return total / count

            with jax.set_mesh(mesh):
                out[attention] = float(jax.jit(loss)(params, tokens))
        except Exception as error:  # noqa: BLE001 -- e.g. cuDNN refusing head dim 160 on A100
            out[attention] = f'{type(error).__name__}: {str(error).splitlines()[0][:160]}'
    return out


def train_step():
    """tokens/s and MFU of the flash step (attention dropout 0.1, MT-NLG's recipe) and of
    'auto' at dropout 0 (cuDNN where it can); the losses of flash / cuDNN / plain agree."""
    rows = []
    for attention, dropout in (('auto', 0.0), ('flash', 0.1)):
        row = dict(attention=attention, attention_dropout=dropout)
        try:
            row.update(_throughput(_step(attention, dropout)))
        except Exception as error:  # noqa: BLE001
            row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
        rows.append(row)
    step = STEPS.get(('flash', 0.1)) or next(iter(STEPS.values()))
    tokens = step.batch[0][0, :2] if step.batch[0].ndim == 3 else step.batch[0][:2]
    losses = _losses(step.state['params'], step.mesh, tokens)
    numbers = [v for v in losses.values() if isinstance(v, float)]
    return dict(
        model=MODEL,
        batch=BATCH,
        rows=rows,
        losses_at_dropout_0=losses,
        losses_agree=len(numbers) > 1 and max(numbers) - min(numbers) <= 2e-2 * abs(numbers[0]),
    )


def fp8_train(steps=3, **model):
    """One train step's loss under each model.fp8 recipe against bf16's: the check's model
    (MODEL, attention 'auto' at dropout 0, no hidden dropout) from the same initial state and
    batch, `steps` steps each (the first step's loss is the initial parameters' under each
    recipe's products), then the median step time beside bf16's."""
    rows = []
    for recipe in ('none', 'tensorwise', 'delayed', 'blockwise'):
        row = dict(recipe=recipe)
        STEPS.clear()  # one state in memory at a time
        try:
            step = CompiledStep(config_of('auto', 0.0, hidden_dropout=0.0, fp8=recipe, **model))
            losses = []
            with jax.set_mesh(step.mesh):
                for _ in range(steps):
                    step.state, metrics = step.compiled(step.state, *step.batch, np.float32(1))
                    losses.append(float(metrics['loss']))
            row.update(losses=[round(v, 5) for v in losses], step_s=round(step.step_seconds(3), 4))
            del step  # its state, before the next recipe's
        except Exception as error:  # noqa: BLE001
            row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
        rows.append(row)
    bf16 = rows[0]
    for row in rows[1:]:
        if 'losses' in row and 'losses' in bf16:
            row['first_loss_vs_bf16'] = round(row['losses'][0] / bf16['losses'][0] - 1, 5)
            row['last_loss_vs_bf16'] = round(row['losses'][-1] / bf16['losses'][-1] - 1, 5)
            row['x_bf16_time'] = round(row['step_s'] / bf16['step_s'], 3)
    return dict(model={**MODEL, **model}, batch=BATCH, rows=rows)


def _target():
    kind = jax.devices()[0].device_kind.lower()
    return next((name for name in CLUSTERS if name.split('-')[0] in kind), None)


def memory():
    """The device's peak against XLA's memory_analysis() and the plan (launch/plan.py)."""
    step = next(iter(STEPS.values()))
    analysis = step.compiled.memory_analysis()
    compiled = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)  # fmt: skip
    stats = jax.devices()[0].memory_stats() or {}
    target = _target()
    parts = report.make_plan(step.config, target)['per_device_bytes'] if target else {}
    planned = parts.get('total')
    peak = stats.get('peak_bytes_in_use')
    return dict(
        config=f'attention {step.config.model.attention}, target {target}',
        device_peak_gib=peak and round(peak / 2**30, 2),
        memory_analysis_gib=round(compiled / 2**30, 2),
        planned_gib=planned and round(planned / 2**30, 2),
        planned_parts_gib={key: round(value / 2**30, 2) for key, value in parts.items()},
        device_vs_compiled=peak and round(peak / compiled, 3),
        device_vs_planned=peak and planned and round(peak / planned, 3),
    )


def loop_copies(hlo_text, threshold=MIB):
    """[(bytes, type, computation)] of copies over `threshold` bytes in computations a while
    loop runs (a conditional in a loop included): what a step copies over and over."""
    computations, entry = hlo_module.parse_module(hlo_text)
    runs, _ = hlo_module.execution_counts(computations, entry)
    found = []
    for name, instructions in computations.items():
        if not runs.get(name, (0, False))[1]:
            continue
        for instruction in instructions:
            size = hlo_module.shape_bytes(instruction.type_text)
            if instruction.opcode in ('copy', 'copy-start') and size > threshold:
                found.append((size, instruction.type_text, name))
    return sorted(found, reverse=True)


def hlo():
    """The real compile's HLO: loop copies over 1 MiB, attention kernels, FLOPs vs model."""
    step = next(iter(STEPS.values()))
    text = step.compiled.as_text()
    config = step.config
    copies = loop_copies(text)
    params = counts.count_params(step.setup.abstract_state['params'])
    tokens = config.train.global_batch * config.model.seq_len
    model_flops = counts.model_flops_per_token(config.model, params) * tokens
    return dict(
        loop_copies_over_1_mib=len(copies),
        loop_copy_gib=round(sum(size for size, _, _ in copies) / 2**30, 3),
        largest_loop_copies=[f'{t} in {c}' for _, t, c in copies[:5]],
        attention_kernels=hlo_module.attention_kernel_counts(text),
        compiled_vs_model_flops=round(hlo_module.dot_flops(text) / model_flops, 4),
    )


KIND_MARKS = (  # (kind, substrings of a GPU kernel's name), the first that matches
    ('attention', ('flash_attention', 'fmha', 'sdpa', 'cudnn', 'mha')),
    ('collectives', ('nccl', 'all_reduce', 'all_gather', 'reduce_scatter')),
    ('matmuls', ('gemm', 'cublas', 'cutlass', 'xmma', 'nvjet', 'matmul', 'dot')),
    ('copies', ('copy', 'memcpy')),
    ('slicing', ('dynamic_update_slice', 'dynamic_slice', 'dynamic-update-slice', 'slice')),
    ('transposes', ('transpose',)),
)


def kind_of(kernel_name):
    name = kernel_name.lower()
    return next((kind for kind, marks in KIND_MARKS if any(m in name for m in marks)),
                'elementwise')  # fmt: skip


def kernel_seconds(trace_dir):
    """({kernel name: seconds}, the line names seen) of the GPU kernels in the newest trace
    under trace_dir, from the device planes' stream lines (not the 'XLA Ops' / 'XLA Modules'
    summary lines)."""
    paths = sorted(pathlib.Path(trace_dir).rglob('*.xplane.pb'), key=lambda p: p.stat().st_mtime)
    data = jax.profiler.ProfileData.from_file(str(paths[-1]))
    kernels, lines_seen = collections.Counter(), set()
    for plane in data.planes:
        if not plane.name.startswith('/device:GPU'):
            continue
        for line in plane.lines:
            lines_seen.add(line.name)
            if line.name.startswith('Stream'):
                for event in line.events:
                    kernels[event.name] += event.duration_ns / 1e9
    return kernels, sorted(lines_seen)


# kind_of's kinds as the replay names them (plan/overlap.py's KINDS)
REPLAY_KIND = {'attention': 'attention kernels', 'slicing': 'slicing and slot writes'}


def replay_kinds(replay):
    """{kernel name: the replay's kind} of every instruction of the compiled module: XLA:GPU
    names a fusion's kernel after the fusion, '.' and '-' written '_'."""
    kinds = {}
    for computation in replay.computations.values():
        types = {instruction.name: instruction.type_text for instruction in computation}
        for instruction in computation:
            kinds[re.sub(r'[.\-]', '_', instruction.name)] = replay.kind(instruction, types)
    return kinds


def by_replay_kind(kernels, kinds):
    """Measured seconds by the replay's kinds: a kernel named after an instruction counts as
    the replay counts that instruction, any other (cuBLAS's GEMMs, Pallas kernels, memcpys) by
    its name (kind_of), so measured and replayed time split alike."""
    seconds = collections.Counter()
    for name, spent in kernels.items():
        kind = kinds.get(name) or REPLAY_KIND.get(kind_of(name), kind_of(name))
        seconds[kind] += spent
    return seconds


def profile(trace_dir, steps=2):
    """Two traced steps, device time by kind, beside the replay of the same compile."""
    step = next(iter(STEPS.values()))
    with profile_lib.tracing(trace_dir):  # the trace train.profile_start takes
        step.step_times(steps, warmup=0)
    kernels, lines = kernel_seconds(trace_dir)
    by_name = collections.Counter()
    for name, spent in kernels.items():
        by_name[kind_of(name)] += spent
    target = _target()
    replay = {}
    if target:
        cluster = overlap.Target.of_cluster(CLUSTERS[target], step.config.model.compute_dtype)
        replay = overlap.collective_overlap(step.compiled.as_text(), step.mesh, target=cluster)
    by_replay = by_replay_kind(kernels, replay_kinds(replay['replay'])) if replay else {}

    def per_step(seconds):
        return {kind: round(s / steps, 4) for kind, s in seconds.most_common()}

    return dict(
        trace=str(trace_dir),
        device_s_per_step_by_kind=per_step(by_name),
        device_s_per_step_by_replay_kind=per_step(by_replay) if replay else None,
        replay_step_s=replay.get('step_s'),
        replay_time_by_kind=replay.get('time_by_kind'),
        device_lines=lines,
        top_kernels=[
            dict(kernel=name[:80], kind=kind_of(name), ms_per_step=round(1e3 * s / steps, 2))
            for name, s in kernels.most_common(12)
        ],  # fmt: skip
    )
