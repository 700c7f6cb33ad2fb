"""GPT-3's block against Llama's on this machine: each config's step time beside its model
FLOPs, under its own layout (configs/tiny.py and configs/tiny_llama.py by default).

    python bench/blocks.py [--configs configs/tiny.py configs/tiny_llama.py] [--rounds 5]

Both steps are compiled first; then each round times --steps steps of each config in turn, so
a load that comes and goes on a shared machine touches both alike. The target (issue 30):
the step-time ratio within 15 % of the model-FLOPs ratio (6N + 12LHQT per token), i.e. the
Llama block costs what its arithmetic says, no more.
"""

import statistics

from common import CompiledStep, own_layout_config, print_table

from mtnlg_jax.model import counts
from mtnlg_jax.run.cli import ArgumentParser


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--configs', nargs='+', default=['configs/tiny.py', 'configs/tiny_llama.py']
    )
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--steps', type=int, default=3)
    args = parser.parse_args()

    compiled = {path: CompiledStep(own_layout_config(path)) for path in args.configs}
    times = {path: [] for path in compiled}
    for _ in range(args.rounds):
        for path, step in compiled.items():
            times[path] += step.step_times(args.steps)
    rows, base = [], None
    for path, step in compiled.items():
        model = step.config.model
        flops = counts.model_flops_per_token(model, counts.param_count(model))
        seconds = statistics.median(times[path])
        base = base or (flops, seconds)
        rows.append(
            [
                path,
                f'{counts.param_count(model) / 1e6:.2f} M',
                f'{flops / 1e6:.1f} M',
                f'{seconds:.3f}',
                f'{flops / base[0]:.3f}',
                f'{seconds / base[1]:.3f}',
                f'{(seconds / base[1]) / (flops / base[0]):.3f}',
            ]
        )
    print_table(
        'GPT-3 and Llama blocks: step time against model FLOPs',
        [
            'config',
            'parameters',
            'FLOPs/token',
            'step s',
            'FLOPs ratio',
            'time ratio',
            'time/FLOPs',
        ],
        rows,
    )


if __name__ == '__main__':
    main()
