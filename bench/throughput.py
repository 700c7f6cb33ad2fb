"""Throughput of a config on one device and on the 8-device layouts, measured in one process.

    python bench/throughput.py [--config configs/tiny.py] [--rounds 5] [--steps 3]
                               [--micro_steps 2]

Columns: layout (data x stage x tensor), compile time (ahead of time, the whole jitted train
step), step time (median of all timed steps: every layout compiled first, then each round
times --steps steps of every layout in turn, so a load that comes and goes on a shared
machine touches all rows alike), tokens/s, and model
TFLOP/s per device (6N + 12LHQT per token). Same global batch and micro-step count everywhere,
no pipeline, so rows compare layouts, not batch sizes. On a CPU the 8 devices are simulated
and share its cores: the tensor-parallel rows measure the cost of the collectives, not a
speed-up. bench/pipeline.py compares the pipelined layouts.
"""

import statistics

from common import CompiledStep, layout_config, print_table

from mtnlg_jax.model import counts
from mtnlg_jax.run.cli import ArgumentParser

LAYOUTS = [(1, 1, 1), (8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8)]


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/tiny.py')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--micro_steps', type=int, default=2)
    args = parser.parse_args()

    compiled = {}
    for data, stage, tensor in LAYOUTS:
        config = layout_config(
            args.config, data, stage, tensor, args.micro_steps, **{'model.remat': 'none'}
        )
        compiled[data, stage, tensor] = CompiledStep(config)
    times = {layout: [] for layout in compiled}
    for _ in range(args.rounds):
        for layout, step in compiled.items():
            times[layout] += step.step_times(args.steps)

    rows = []
    for (data, stage, tensor), step in compiled.items():
        config = step.config
        seconds = statistics.median(times[data, stage, tensor])
        tokens_per_s = config.train.global_batch * config.model.seq_len / seconds
        num_params = counts.count_params(step.setup.layer_abstract_state['params'])
        devices = data * stage * tensor
        tflops = counts.model_flops_per_token(config.model, num_params) * tokens_per_s / devices
        rows.append(
            (
                f'{data} x {stage} x {tensor}',
                devices,
                config.train.micro_steps,
                f'{step.compile_s:.1f}',
                f'{seconds:.3f}',
                f'{tokens_per_s:,.0f}',
                f'{tflops / 1e12:.4f}',
            )
        )
    header = (
        'data x stage x tensor',
        'devices',
        'micro-steps',
        'compile s',
        'step s',
        'tokens/s',
        'model TFLOP/s per device',
    )
    print_table(f'Throughput of {args.config}', header, rows)


if __name__ == '__main__':
    main()
