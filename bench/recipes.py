"""Which recipe of the 530 B model is fastest on the paper's layout: each compiled by XLA:GPU.

    python bench/recipes.py [--results DIR] [--reuse] [--targets a100-80gb h100-80gb]

Every row is `launch/plan.py --config configs/mtnlg_530b.py --devices 2240 --target TARGET
ARGS --json DIR/NAME.TARGET.json`: the whole layout (data 8 x stage 35 x tensor 8, 240
micro-batches of 1 sequence, sequence parallel) compiled for compile-only GPUs in one process
(needs `make gpu-compile`). How to read it: peak GB is XLA:GPU's arguments + unaliased outputs
+ temporaries per device; compiled / model FLOPs is the step's matmul FLOPs (loops and the
engine's table weighed in, fused attention counted) x devices / 6N + 12LHQT per token: 1.00 is
no recompute at all; the predicted step is the planner's (plan/predict.py: the engine's
schedule table tick by tick, each tick its slowest stage, the communication each collective
leaves exposed taken from the compile's overlap table): it counts the pipeline's bubble and
ranks the recipes; replayed work is plan/overlap.py's replay of one device's compiled
schedule (compute at peak, collectives at link speed), which weighs the engine's idle slots
by how often they occur and so leaves the lockstep bubble out: compare it between recipes of
one schedule only. Exposed is the communication the replay waits for. The winner is the
default of configs/mtnlg_530b.py; the paper's recipe is `paper` (remat full, 1F1B).
"""

import sys


from mtnlg_jax.xla import gpu_compile
from plan_runs import ROOT, argument_parser, print_markdown, read_plan, run_plans

PAPER = ['--config.model.remat=full', '--config.pipeline.repeats=1']
RECIPES = {  # name: overrides of configs/mtnlg_530b.py
    'paper': PAPER,
    'full, in flight 35': PAPER + ['--config.pipeline.max_in_flight=35'],
    'selective': ['--config.pipeline.repeats=1'],
    'selective, in flight 35': [
        '--config.pipeline.repeats=1',
        '--config.pipeline.max_in_flight=35',
    ],
    'selective, interleaved 3': [],  # the config's default
    'none, interleaved 3': ['--config.model.remat=none'],
    'selective, interleaved 3, no attention dropout': ['--config.model.attention_dropout=0.0'],
}
# H100 rows: the paper's recipe, the default, and the default with cuDNN's flash attention
# (head dimension 160 is within its limit there once attention dropout is off).
H100_RECIPES = (
    'paper',
    'selective, interleaved 3',
    'selective, interleaved 3, no attention dropout',
)
GB = 1e9


def command(name, target, results):
    return [
        sys.executable,
        str(ROOT / 'launch/plan.py'),
        '--config',
        'configs/mtnlg_530b.py',
        '--devices',
        '2240',
        '--target',
        target,
        *RECIPES[name],
        '--json',
        str(json_path(results, name, target)),
    ]


def json_path(results, name, target):
    return results / f'{name.replace(", ", "_").replace(" ", "-")}.{target}.json'


def row(name, target, plan):
    compiled, c = plan['compiled'], plan['config']
    over = compiled['overlap']
    return [
        name,
        target,
        f'{c["remat"]}, v {c["repeats"]}, micro-batch {c["micro_batch"]}, m {c["micro_steps"]}',
        f'{compiled["peak_bytes"] / GB:.1f}',
        'yes' if compiled['peak_bytes'] <= 80 * GB else 'NO',
        f'{compiled["flops_vs_model"]:.3f}',
        'yes' if compiled['attention']['fused'] else 'no',
        f'{plan["cluster"]["predicted_step_s"]:.1f}',
        f'{over["step_s"]:.2f}',
        f'{over["exposed_s"]:.2f} ({100 * over["exposed_vs_compute"]:.1f} %)',
    ]


HEADER = [
    'recipe',
    'target',
    'remat, repeats, micro-batch, micro-batches',
    'XLA:GPU peak GB',
    'fits 80 GB',
    'compiled / model FLOPs',
    'fused attention',
    'predicted step s',
    'replayed work s',
    'exposed comm s (of compute)',
]


def main():
    parser = argument_parser(__doc__, 'runs/recipes')
    parser.add_argument('--targets', nargs='*', default=['a100-80gb', 'h100-80gb'])
    args = parser.parse_args()
    missing = gpu_compile.missing()
    if missing:
        sys.exit(f'error: {missing}')
    results = args.results
    todo = [
        (name, target)
        for target in args.targets
        for name in (H100_RECIPES if target == 'h100-80gb' else RECIPES)
    ]
    jobs = [
        (f'{name} on {target}', command(name, target, results), json_path(results, name, target))
        for name, target in todo
    ]
    run_plans(jobs, args.reuse, 'plan --target')
    print('\n530 B on data 8 x stage 35 x tensor 8 (2,240 GPUs), compiled by XLA:GPU per recipe')
    print(f'command: python {" ".join(sys.argv)}')
    print(
        'each row: python launch/plan.py --config configs/mtnlg_530b.py --devices 2240 '
        '--target TARGET ARGS'
    )
    print_markdown(HEADER, [row(n, t, read_plan(json_path(results, n, t))) for n, t in todo])
    print(
        'ARGS per recipe: '
        + '; '.join(f'{n}: {" ".join(a) or "(none)"}' for n, a in RECIPES.items())
    )


if __name__ == '__main__':
    main()
