"""Throughput of a config on one device and on the 8-device layouts, measured in one process.

    python bench/throughput.py [--config configs/tiny.py] [--steps 5]

Columns: layout (data x stage x tensor), compile time (ahead of time, the whole jitted train
step), step time (median of --steps timed steps after one warm-up), tokens/s, and model
TFLOP/s per device (6N + 12LHQT per token). Same global batch and micro-step count everywhere,
no pipeline, so rows compare layouts, not batch sizes. On a CPU the 8 devices are simulated
and share its cores: the tensor-parallel rows measure the cost of the collectives, not a
speed-up. bench/pipeline.py compares the pipelined layouts.
"""

import argparse

from common import CompiledStep, layout_config, print_table

from mtnlg_jax import plan

LAYOUTS = [(1, 1, 1), (8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/tiny.py')
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--micro-steps', type=int, default=2)
    args = parser.parse_args()

    rows = []
    for data, stage, tensor in LAYOUTS:
        config = layout_config(
            args.config, data, stage, tensor, args.micro_steps, **{'model.remat': 'none'}
        )
        step = CompiledStep(config)
        seconds = step.step_seconds(args.steps)
        tokens_per_s = config.train.global_batch * config.model.seq_len / seconds
        num_params = plan.count_params(step.setup.abstract_state['params'])
        devices = data * stage * tensor
        tflops = plan.model_flops_per_token(config.model, num_params) * tokens_per_s / devices
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
