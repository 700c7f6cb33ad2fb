"""The scale check of the paper configs: planned and compiled by XLA:CPU and XLA:GPU.

    python bench/scale.py [--results DIR] [--reuse] [--only NAME ...]

Each config runs `launch/plan.py --compile --cluster a100-80gb --json DIR/NAME.json` in its
own process (each needs its own forced CPU device count), at the layout of its paper:

    tiny           data 2 x stage 2 x tensor 2 (8 devices, as configured)
    gpt2_124m      data 8 (8 devices)
    megatron_8_3b  data 64 x tensor 8 (512 GPUs, Megatron-LM 2019's 8.3 B run), 1 micro-batch
    mtnlg_530b     data 8 x stage 35 x tensor 8 (2,240 GPUs, the paper's): compiled as one
                   replica, 280 CPU devices, at its real 240 micro-batches (XLA:CPU allows
                   2,048 devices per process)
    tiny_llama     data 2 x stage 2 x tensor 2, Llama's block (8 devices, as configured)
    llama3_70b     data 2 x stage 8 x tensor 8 (128 H100s)
    llama3_405b    data 64 x stage 16 x tensor 8 (8,192 H100s, Meta's layout)

Then, where the XLA:GPU compiler is installed (make gpu-compile), each config again with
`--target a100-80gb` (and the 530 B also `--target h100-80gb`): the whole layout compiled for
compile-only GPUs in one process, 2,240 of them for MT-NLG (DIR/NAME.TARGET.json), in a second
table: XLA:GPU's peak per device next to XLA:CPU's, compiled / model FLOPs, whether attention
ran fused, and the exposed communication of the overlap replay (plan/overlap.py).

A compile that fails is its table's row `failed: CAUSE` (launch/plan.py's `error:` line), the
others run and both tables are printed; the benchmark then exits 1 naming the failed ones.

--reuse keeps a config's JSON already in DIR (the 530 B compile takes minutes). How to read
the table: "planned" is the plan of the layout on GPUs (bf16 where the config says so);
"planned as compiled" the plan of the compiled layout computed in fp32, as XLA:CPU compiles a
bf16 step; "compiled peak" is memory_analysis()'s arguments + unaliased outputs +
temporaries per device; bytes per step are what one device sends (ring algorithms) over each
mesh axis, all kinds summed (compiled: the HLO inventory, loop trip counts multiplied in);
FLOPs ratio: matmul FLOPs of the compiled step x devices / model FLOPs (6N + 12LHQT per
token): recompute and pipeline bubble make it exceed 1.
"""

import os
import sys


from mtnlg_jax.xla import gpu_compile
from plan_runs import ROOT, argument_parser, failed_row, print_markdown, read_plan, run_plans
from mtnlg_jax.plan.comm import by_axis

RUNS = {  # name: launch/plan.py arguments after --config
    'tiny': [],
    'gpt2_124m': ['--devices', '8'],
    'megatron_8_3b': ['--devices', '512'],
    'mtnlg_530b': ['--devices', '2240'],
    'tiny_llama': [],
    'llama3_70b': ['--devices', '128'],
    'llama3_405b': ['--devices', '8192'],
}
GPU_TARGETS = {  # others: A100 80 GB, the papers'
    'mtnlg_530b': ('a100-80gb', 'h100-80gb'),
    'llama3_70b': ('h100-80gb',),
    'llama3_405b': ('h100-80gb',),  # Meta's
}
GB = 1e9


def plan_command(name, results, target=None):
    compile_args = ['--target', target] if target else ['--compile', '--cluster', 'a100-80gb']
    return [
        sys.executable,
        str(ROOT / 'launch/plan.py'),
        '--config',
        f'configs/{name}.py',
        *RUNS[name],
        *compile_args,
        '--json',
        str(json_path(results, name, target)),
    ]


def json_path(results, name, target=None):
    return results / (f'{name}.json' if target is None else f'{name}.{target}.json')


def runs(names, with_gpu):
    """(name, target) of every compile to make: XLA:CPU's (target None), then XLA:GPU's."""
    out = [(name, None) for name in names]
    if with_gpu:
        out += [(name, t) for name in names for t in GPU_TARGETS.get(name, ('a100-80gb',))]
    return out


def axis_cell(comm):
    """'tensor 63.8, data 8.22' in GB; axes under 1 % of the total (scalars, reshards) left out."""
    axes = by_axis(comm)
    total = sum(axes.values())
    kept = sorted((a, v) for a, v in axes.items() if v >= 0.01 * total)
    return ', '.join(f'{axis} {value / GB:.3g}' for axis, value in kept) or '-'


def layout(mesh):
    return f'{mesh["data"]} x {mesh["stage"]} x {mesh["tensor"]}'


def row(name, plan):
    compiled = plan['compiled']
    c, cc = plan['config'], compiled['config']
    as_compiled = compiled['planned_as_compiled']
    return [
        name,
        f'{plan["params"] / 1e9:.3g} B',
        f'{layout(c["mesh"])}, m {c["micro_steps"]}',
        f'{layout(cc["mesh"])}, m {cc["micro_steps"]}',
        f'{plan["per_device_bytes"]["total"] / GB:.3g}',
        f'{as_compiled["per_device_bytes"]["total"] / GB:.3g}',
        f'{compiled["peak_bytes"] / GB:.4g}',
        axis_cell(as_compiled['comm_bytes_per_device']),
        axis_cell(compiled['comm_bytes_per_device']),
        f'{compiled["flops_vs_model"]:.2f}',
        f'{compiled["compile_s"]:.0f}',
        'yes' if plan['per_device_bytes']['total'] <= 80 * GB else 'no',
        'yes' if compiled['peak_bytes'] <= 80 * GB else 'no',
    ]


HEADER = [
    'config',
    'params',
    'layout d x p x t (GPUs)',
    'compiled d x p x t (CPU)',
    'planned GB/device',
    'planned as compiled GB',
    'compiled peak GB',
    'planned GB/step by axis (as compiled)',
    'compiled GB/step by axis',
    'compiled / model FLOPs',
    'compile s',
    'fits 80 GB (plan)',
    'fits 80 GB (compiled)',
]


def gpu_row(name, target, plan, cpu_plan):
    compiled = plan['compiled']
    over = compiled['overlap']
    c = plan['config']
    return [
        name,
        target,
        f'{layout(c["mesh"])} ({compiled["devices"]:,} GPUs), m {c["micro_steps"]}',
        f'{plan["per_device_bytes"]["total"] / GB:.3g}',
        f'{cpu_plan["compiled"]["peak_bytes"] / GB:.4g}' if cpu_plan else '-',
        f'{compiled["peak_bytes"] / GB:.4g}',
        f'{compiled["flops_vs_model"]:.2f}',
        'yes' if compiled['attention']['fused'] else 'no',
        f'{over["compute_s"]:.2f}',
        f'{over["exposed_s"]:.2f} ({100 * over["exposed_vs_compute"]:.1f} %)',
        f'{compiled["compile_s"]:.0f}',
        'yes' if compiled['peak_bytes'] <= 80 * GB else 'no',
    ]


GPU_HEADER = [
    'config',
    'target',
    'layout d x p x t, compiled whole',
    'planned GB/device',
    'XLA:CPU peak GB',
    'XLA:GPU peak GB',
    'compiled / model FLOPs',
    'fused attention',
    'compute at peak s',
    'exposed comm s (of compute)',
    'compile s',
    'fits 80 GB',
]


def job_name(name, target):
    return f'{name} {target or "cpu"}'


def main():
    parser = argument_parser(__doc__, 'runs/scale')
    parser.add_argument('--only', nargs='*', choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    results = args.results
    missing = gpu_compile.missing()
    todo = runs(args.only, with_gpu=missing is None)
    jobs = [
        (
            job_name(name, target),
            plan_command(name, results, target),
            json_path(results, name, target),
        )
        for name, target in todo
    ]
    failed = run_plans(jobs, args.reuse, 'plan --compile', keep_going=True)
    print('\nScale check: planned and compiled train steps, per device')
    print(f'command: python {" ".join(sys.argv)}')
    print(
        f'each row: python launch/plan.py --config configs/NAME.py ARGS --compile --cluster '
        f'a100-80gb --json {results}/NAME.json, ARGS: {RUNS}'
    )
    print(f'machine: {os.cpu_count()} CPU cores (compile times are noisy on a shared machine)')
    print_markdown(HEADER, [cpu_table_row(name, results, failed) for name in args.only])
    print('\nXLA:GPU: the same train steps compiled for compile-only GPUs (plan.py --target)')
    if missing is not None:
        print(f'skipped: {missing}')
    else:
        print(
            'each row: python launch/plan.py --config configs/NAME.py ARGS --target TARGET '
            f'--json {results}/NAME.TARGET.json; exposed comm: the overlap replay of the compiled '
            'schedule (compute at peak, collectives at the link bandwidths)'
        )
        rows = [gpu_table_row(name, t, results, failed) for name, t in todo if t is not None]
        print_markdown(GPU_HEADER, rows)
    if failed:
        sys.exit(f'{len(failed)} of {len(jobs)} compiles failed: {", ".join(failed)}')


def cpu_table_row(name, results, failed):
    why = failed.get(job_name(name, None))
    if why is not None:
        return failed_row(HEADER, [name], why)
    return row(name, read_plan(json_path(results, name)))


def gpu_table_row(name, target, results, failed):
    why = failed.get(job_name(name, target))
    if why is not None:
        return failed_row(GPU_HEADER, [name, target], why)
    cpu_path = json_path(results, name)
    cpu_plan = None
    if job_name(name, None) not in failed and cpu_path.exists():
        cpu_plan = read_plan(cpu_path)
    return gpu_row(name, target, read_plan(json_path(results, name, target)), cpu_plan)


if __name__ == '__main__':
    main()
