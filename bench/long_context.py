"""Long context, compiled: memory per device and the step against the sequence length.

    python bench/long_context.py [--results DIR] [--reuse] [--only gpu|cpu]

gpu (XLA:GPU for compile-only H100s, `make gpu-compile`): Llama 3 8B (configs/llama3_8b.py)
on 16 H100s at sequences 8192 to 131072, each over context c = seq / 8192 ranks, so that a
device holds 8192 / t tokens of a sequence at every length; tensor t = min(8, 16 / c) inside a
node, data the rest; 4 sequences a step, one a micro-batch; `launch/plan.py --target
h100-80gb --json DIR/NAME.json`. Columns: XLA:GPU's peak per device (memory_analysis),
compiled / model FLOPs (attention kernels by the score blocks they compute), the attention
kernels run, the overlap replay's exposed communication and step (plan/overlap.py: compute at
peak, so a lower bound), and the replayed step per million tokens.

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
from plan_runs import ROOT, argument_parser, print_markdown, read_plan, run_plans

SEQUENCES = (8192, 16384, 32768, 65536, 131072)
GPUS = 16
GB = 1e9


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


def cpu_jobs(results):
    jobs = []
    for name, overrides in (('context4', []), ('context1', ['--config.mesh.context=1'])):
        path = results / f'tiny_llama_8k_{name}.json'
        command = [sys.executable, 'launch/plan.py', '--config', 'configs/tiny_llama_8k.py',
                   '--compile', '--json', str(path), *overrides]  # fmt: skip
        jobs.append((f'tiny_llama_8k {name}', command, path))
    return jobs


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
            ', '.join(f'{k} {v}' for k, v in sorted(compiled['attention']['kernels'].items())),
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
    parser.add_argument('--only', choices=('gpu', 'cpu'))
    args = parser.parse_args()
    results = (ROOT / args.results).resolve()
    if args.only != 'cpu':
        missing = gpu_compile.missing()
        if missing:
            sys.exit(f'error: the gpu part needs {missing}')
        run_plans(gpu_jobs(results), args.reuse, 'XLA:GPU')
        gpu_table(results)
    if args.only != 'gpu':
        run_plans(cpu_jobs(results), args.reuse, 'XLA:CPU')
        cpu_table(results)


if __name__ == '__main__':
    main()
