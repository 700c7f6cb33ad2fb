"""Long context, compiled: memory per device and the step against the sequence length.

    python bench/long_context.py [--results DIR] [--reuse] [--only gpu|cpu|gpu405]

gpu (XLA:GPU for compile-only H100s, `make gpu-compile`): Llama 3 8B (configs/llama3_8b.py)
on 16 H100s at sequences 8192 to 131072, each over context c = seq / 8192 ranks, so that a
device holds 8192 / t tokens of a sequence at every length; tensor t = min(8, 16 / c) inside a
node, data the rest; 4 sequences a step, one a micro-batch; `launch/plan.py --target
h100-80gb --json DIR/NAME.json`. Columns: XLA:GPU's peak per device (memory_analysis),
compiled / model FLOPs (attention kernels by the score blocks they compute), the attention
kernels run, the overlap replay's exposed communication and step (plan/overlap.py: compute at
peak, so a lower bound), and the replayed step per million tokens.

gpu405 (XLA:GPU, only when asked for: five compiles of 16,384 GPUs, minutes each): Llama 3
405B on 16,384 H100s as configs/llama3_405b_128k.py (tensor 8 x pipeline 16, its micro-batch,
schedule, recompute and rope scaling) at sequences 8192 to 131072 over context c = seq / 8192,
data 16384 / (8 x 16 x c), 16 M tokens a step at every length (the config's 128 x 131072):
16 micro-batches a replica throughout. Columns: the gpu part's, whether the compiled peak fits
80 GB (else the plan's figure beside it), the replayed step with each pipeline tick at its
slowest stage (plan/lockstep.py), and the predicted step and MFU with the replay's hidden
shares (plan/predict.py). A compile that fails is a row `failed: CAUSE`; the others run, the
table is printed and the benchmark exits 1 naming the failed ones.

cpu (XLA:CPU, forced host devices): configs/tiny_llama_8k.py (sequence 8192) as configured,
context 4 x tensor 2, against context 1 x tensor 2 (`launch/plan.py --compile`): memory per
device, the plan's and the compile's.

How to read it: with the tokens a device holds fixed, the matmul work a token does is fixed
and attention's grows with the keys each query sees (the sequence), so the step per token
grows about linearly in the sequence; memory per device grows only by the gathered keys and
values (and their gradients) of the layer being recomputed, and the plain path's scores
(XLA:CPU) by (s / c) x s.
"""

import sys

from mtnlg_jax.xla import gpu_compile
from plan_runs import ROOT, argument_parser, failed_row, print_markdown, read_plan, run_plans

SEQUENCES = (8192, 16384, 32768, 65536, 131072)
GPUS = 16
GB, GIB = 1e9, 2**30
GPUS_405B, TENSOR_405B, STAGES_405B = 16384, 8, 16
TOKENS_405B = 128 * 131072  # configs/llama3_405b_128k.py's step: 16 M tokens at every length


def gpu_layout(seq):
    """(context, tensor, data) of the 16-GPU layout at sequence `seq`."""
    context = seq // 8192
    tensor = min(8, GPUS // context)
    return context, tensor, GPUS // (context * tensor)


def gpu_jobs(results):
    jobs = []
    for seq in SEQUENCES:
        context, tensor, data = gpu_layout(seq)
        overrides = [
            f'--config.model.seq_len={seq}',
            f'--config.mesh.context={context}',
            f'--config.mesh.tensor={tensor}',
            f'--config.mesh.data={data}',
            '--config.train.global_batch=4',
            '--config.train.micro_batch=1',
            '--config.train.rampup.start=0',
            '--config.train.rampup.increment=0',
            '--config.train.rampup.tokens=0',
        ]
        path = results / f'llama3_8b_{seq}.json'
        command = [sys.executable, 'launch/plan.py', '--config', 'configs/llama3_8b.py',
                   '--devices', str(GPUS), '--target', 'h100-80gb', '--json', str(path),
                   *overrides]  # fmt: skip
        jobs.append((f'llama3_8b seq {seq}', command, path))
    return jobs


def gpu405_layout(seq):
    """(context, data) of the 405B at sequence `seq`: tensor 8 x pipeline 16 as the 128K config,
    context seq / 8192, data the rest of 16,384 H100s."""
    context = seq // 8192
    return context, GPUS_405B // (TENSOR_405B * STAGES_405B * context)


def gpu405_name(seq):
    return f'llama3_405b seq {seq}'


def gpu405_jobs(results):
    jobs = []
    for seq in SEQUENCES:
        context, data = gpu405_layout(seq)
        overrides = [
            f'--config.model.seq_len={seq}',
            f'--config.mesh.context={context}',
            f'--config.mesh.data={data}',
            f'--config.train.global_batch={TOKENS_405B // seq}',
            # XLA's own scheduling estimate at every length, as the 8B part: the config's
            # second compile by profiled costs (train.pgle_profile_steps) is docs/gpu.md's
            '--config.train.pgle_profile_steps=0',
        ]
        path = results / f'llama3_405b_{seq}.json'
        command = [sys.executable, 'launch/plan.py', '--config', 'configs/llama3_405b_128k.py',
                   '--devices', str(GPUS_405B), '--target', 'h100-80gb', '--json', str(path),
                   *overrides]  # fmt: skip
        jobs.append((gpu405_name(seq), command, path))
    return jobs


def cpu_jobs(results):
    jobs = []
    for name, overrides in (('context4', []), ('context1', ['--config.mesh.context=1'])):
        path = results / f'tiny_llama_8k_{name}.json'
        command = [sys.executable, 'launch/plan.py', '--config', 'configs/tiny_llama_8k.py',
                   '--compile', '--json', str(path), *overrides]  # fmt: skip
        jobs.append((f'tiny_llama_8k {name}', command, path))
    return jobs


def kernels_cell(compiled):
    return ', '.join(f'{k} {v}' for k, v in sorted(compiled['attention']['kernels'].items()))


def gpu_table(results):
    rows = []
    for seq in SEQUENCES:
        plan = read_plan(results / f'llama3_8b_{seq}.json')
        compiled, over = plan['compiled'], plan['compiled']['overlap']
        tokens = plan['config']['global_batch'] * seq
        rows.append([
            seq,
            ' x '.join(str(n) for n in gpu_layout(seq)),
            f'{compiled["peak_bytes"] / GB:.1f}',
            f'{compiled["flops_vs_model"]:.3f}',
            kernels_cell(compiled),
            f'{100 * over["exposed_vs_compute"]:.1f} %',
            f'{over["step_s"]:.3f}',
            f'{over["step_s"] / tokens * 1e6:.2f}',
        ])  # fmt: skip
    print_markdown(
        ['sequence', 'context x tensor x data', 'peak GB', 'compiled / model FLOPs',
         'attention kernels', 'exposed comm.', 'replayed step s',
         'replayed s per M tokens'],
        rows,
    )  # fmt: skip


GPU405_HEADER = [
    'sequence', 'context x data', 'peak GiB', 'fits 80 GB', 'compiled / model FLOPs',
    'attention kernels', 'exposed comm.', 'replayed step s', 'lockstep step s',
    'replayed s per M tokens', 'predicted step s', 'predicted MFU (model TFLOP/s a GPU)',
]  # fmt: skip


def gpu405_table(results, failed):
    rows = []
    for seq in SEQUENCES:
        layout = ' x '.join(str(n) for n in gpu405_layout(seq))
        why = failed.get(gpu405_name(seq))
        if why is not None:
            rows.append(failed_row(GPU405_HEADER, [seq, layout], why))
            continue
        plan = read_plan(results / f'llama3_405b_{seq}.json')
        rows.append([seq, layout, *gpu405_cells(plan, seq)])
    print_markdown(GPU405_HEADER, rows)


def gpu405_cells(plan, seq):
    """The figures of a 405B plan at sequence `seq` after its sequence and layout."""
    compiled, over, cluster = plan['compiled'], plan['compiled']['overlap'], plan['cluster']
    tokens = plan['config']['global_batch'] * seq
    lockstep = over['lockstep']['step_s'] if over.get('lockstep') else None
    fits = compiled['peak_bytes'] <= cluster['hbm_bytes']
    planned = plan['per_device_bytes']['total'] / GIB
    mfu = cluster['predicted_mfu']  # model FLOPs (6N + 12LHQT) a GPU: x peak, the figure
    return [
        f'{compiled["peak_bytes"] / GIB:.1f}',
        'yes' if fits else f'NO (planned {planned:.1f} GiB)',
        f'{compiled["flops_vs_model"]:.3f}',
        kernels_cell(compiled),
        f'{100 * over["exposed_vs_compute"]:.1f} %',
        f'{over["step_s"]:.3f}',
        '-' if lockstep is None else f'{lockstep:.3f}',
        f'{over["step_s"] / tokens * 1e6:.3f}',
        f'{cluster["predicted_step_s"]:.3f}',
        f'{100 * mfu:.1f} % ({mfu * cluster["peak_tflops"]:.0f})',
    ]


def cpu_table(results):
    rows = []
    for name in ('context4', 'context1'):
        plan = read_plan(results / f'tiny_llama_8k_{name}.json')
        mesh = plan['config']['mesh']
        planned = plan['compiled']['planned_as_compiled']['per_device_bytes']['total']
        rows.append([
            ' x '.join(f'{axis} {mesh.get(axis, 1)}' for axis in ('data', 'context', 'tensor')),
            f'{planned / 2**20:.0f}',
            f'{plan["compiled"]["peak_bytes"] / 2**20:.0f}',
            f'{plan["compiled"]["compile_s"]:.1f}',
        ])  # fmt: skip
    print_markdown(['layout', 'planned MiB (fp32)', 'compiled peak MiB', 'compile s'], rows)


def main():
    parser = argument_parser(__doc__, 'results/long_context')
    parser.add_argument('--only', choices=('gpu', 'cpu', 'gpu405'))
    args = parser.parse_args()
    results = (ROOT / args.results).resolve()
    if args.only in ('gpu', 'gpu405', None):
        missing = gpu_compile.missing()
        if missing:
            sys.exit(f'error: the {args.only or "gpu"} part needs {missing}')
    if args.only == 'gpu405':
        return run_gpu405(results, args.reuse)
    if args.only != 'cpu':
        run_plans(gpu_jobs(results), args.reuse, 'XLA:GPU')
        gpu_table(results)
    if args.only != 'gpu':
        run_plans(cpu_jobs(results), args.reuse, 'XLA:CPU')
        cpu_table(results)


def run_gpu405(results, reuse):
    jobs = gpu405_jobs(results)
    failed = run_plans(jobs, reuse, 'XLA:GPU', keep_going=True)
    gpu405_table(results, failed)
    if failed:
        sys.exit(f'{len(failed)} of {len(jobs)} compiles failed: {", ".join(failed)}')


if __name__ == '__main__':
    main()
