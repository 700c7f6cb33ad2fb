"""The scale check of the four paper configs: planned and compiled, one table.

    python bench/scale.py [--results DIR] [--reuse] [--only NAME ...]

Each config runs `launch/plan.py --compile --cluster a100-80gb --json DIR/NAME.json` in its
own process (each needs its own forced CPU device count), at the layout of its paper:

    tiny           data 2 x stage 2 x tensor 2 (8 devices, as configured)
    gpt2_124m      data 8 (8 devices)
    megatron_8_3b  data 64 x tensor 8 (512 GPUs, Megatron-LM 2019's 8.3 B run), 1 micro-batch
    mtnlg_530b     data 8 x stage 35 x tensor 8 (2,240 GPUs, the paper's): compiled as one
                   replica, 280 CPU devices, at its real 240 micro-batches (XLA:CPU allows
                   2,048 devices per process)

--reuse keeps a config's JSON already in DIR (the 530 B compile takes minutes). How to read
the table: "planned" is the plan of the layout on GPUs (bf16 where the config says so);
"planned as compiled" the plan of the compiled layout computed in fp32, as XLA:CPU compiles a
bf16 step; "compiled peak" is memory_analysis()'s arguments + unaliased outputs +
temporaries per device; bytes per step are what one device sends (ring algorithms) over each
mesh axis, all kinds summed (compiled: the HLO inventory, loop trip counts multiplied in);
FLOPs ratio: matmul FLOPs of the compiled step x devices / model FLOPs (6N + 12LHQT per
token): recompute and pipeline bubble make it exceed 1.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

from tqdm import tqdm

from mtnlg_jax.plan.comm import by_axis

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = {  # name: launch/plan.py arguments after --config
    'tiny': [],
    'gpt2_124m': ['--devices', '8'],
    'megatron_8_3b': ['--devices', '512'],
    'mtnlg_530b': ['--devices', '2240'],
}
GB = 1e9


def plan_command(name, results):
    return [
        sys.executable,
        str(ROOT / 'launch/plan.py'),
        '--config',
        f'configs/{name}.py',
        *RUNS[name],
        '--compile',
        '--cluster',
        'a100-80gb',
        '--json',
        str(results / f'{name}.json'),
    ]


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--results', default='runs/scale', help='folder of the JSON plans')
    parser.add_argument('--reuse', action='store_true', help='keep JSON plans already there')
    parser.add_argument('--only', nargs='*', choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    results = pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    for name in tqdm(args.only, desc='plan --compile', unit='config'):
        path = results / f'{name}.json'
        if args.reuse and path.exists():
            continue
        command = plan_command(name, results)
        tqdm.write(' '.join(command[1:]))
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f'{name}: launch/plan.py failed:\n{done.stderr[-3000:]}')
    print('\nScale check: planned and compiled train steps, per device')
    print(f'command: python {" ".join(sys.argv)}')
    print(
        f'each row: python launch/plan.py --config configs/NAME.py ARGS --compile --cluster '
        f'a100-80gb --json {results}/NAME.json, ARGS: {RUNS}'
    )
    print(f'machine: {os.cpu_count()} CPU cores (compile times are noisy on a shared machine)')
    print('| ' + ' | '.join(HEADER) + ' |')
    print('|' + '|'.join('---' for _ in HEADER) + '|')
    for name in args.only:
        plan = json.loads((results / f'{name}.json').read_text())
        print('| ' + ' | '.join(row(name, plan)) + ' |')


if __name__ == '__main__':
    main()
