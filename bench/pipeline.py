"""The circular pipeline: step time against the other layouts, its bubble, its memory.

    python bench/pipeline.py [--config configs/tiny.py] [--steps 3]

Three tables, all from one run on the same 8 devices:

1. Step time of data 2 x stage 2 x tensor 2 (repeats 1 and 2) against data 8 and data 4 x
   tensor 2, same global batch, as ratios to data 8. On a CPU the 8 devices are simulated
   on shared cores, so stages do not run at the same time: the ratio shows what the schedule
   adds (bubble iterations, activation transfers), not a speed-up.
2. Measured against predicted bubble fraction for p = 2 and 4, v = 1 and 2. Measured: step
   time T grows with the number of micro-batches m as T = c + w m at fixed micro-batch size;
   w / v is the time of one pipeline iteration, and the p - 1 iterations without work cost
   (p - 1) w / v, so the measured bubble is (p - 1) (w / v) / T(m). It is below the predicted
   (p - 1) / (v m + p - 1) by the share of T spent outside the iterations (embedding, head,
   optimizer update).
3. Peak temporary memory per device (XLA's memory analysis of the compiled step) as m grows,
   at fixed micro-batch size: the scan keeps one stage input per iteration, so it grows with
   v m + p - 1.
"""

import argparse

import numpy as np
from common import CompiledStep, layout_config, print_table

from mtnlg_jax.parallel import pipeline

LAYERS = 8  # divisible by p x v = 8


def step_time_table(path, steps):
    layouts = [  # (name, data, stage, tensor, repeats)
        ('data 8', 8, 1, 1, 1),
        ('data 4 x tensor 2', 4, 1, 2, 1),
        ('data 2 x stage 2 x tensor 2, v = 1', 2, 2, 2, 1),
        ('data 2 x stage 2 x tensor 2, v = 2', 2, 2, 2, 2),
    ]
    rows, base = [], None
    for name, data, stage, tensor, repeats in layouts:
        micro_steps = 4 if stage > 1 else 2  # same global batch: 16 = mb x data x m
        config = layout_config(
            path,
            data,
            stage,
            tensor,
            micro_steps,
            repeats,
            **{'model.num_layers': LAYERS, 'model.remat': 'full'},
        )
        seconds = CompiledStep(config).step_seconds(steps)
        base = base or seconds
        bubble = pipeline.bubble_fraction(stage, repeats, config.train.micro_steps)
        rows.append(
            (
                name,
                config.train.micro_steps,
                f'{seconds:.3f}',
                f'{seconds / base:.2f}',
                f'{bubble:.3f}',
            )
        )
    header = ('layout', 'micro-batches', 'step s', 'ratio to data 8', 'predicted bubble')
    print_table('Step time, global batch 16 x 128 tokens, 8 layers, full recompute', header, rows)


def bubble_table(path, steps):
    rows = []
    for stages, repeats in [(2, 1), (2, 2), (4, 1), (4, 2)]:
        micro = [4, 8, 16]
        times = []
        for m in micro:
            config = layout_config(
                path,
                1,
                stages,
                1,
                m,
                repeats,
                **{'model.num_layers': LAYERS, 'model.remat': 'full', 'train.global_batch': m},
            )
            times.append(CompiledStep(config).step_seconds(steps))
        slope, _ = np.polyfit(micro, times, 1)
        iteration = slope / repeats
        for m, seconds in zip(micro, times):
            measured = (stages - 1) * iteration / seconds
            predicted = pipeline.bubble_fraction(stages, repeats, m)
            rows.append(
                (stages, repeats, m, f'{seconds:.3f}', f'{measured:.3f}', f'{predicted:.3f}')
            )
    header = ('p', 'v', 'm', 'step s', 'measured bubble', 'predicted (p-1)/(vm+p-1)')
    print_table('Bubble fraction, 1 sequence per micro-batch, stage only', header, rows)


def memory_table(path):
    rows = []
    for stages, repeats in [(2, 1), (2, 2), (4, 1), (4, 2)]:
        for m in [2, 4, 8, 16]:
            if repeats > 1 and m < stages:
                rows.append((stages, repeats, m, 'n/a (v > 1 needs m >= p)'))
                continue
            config = layout_config(
                path,
                1,
                stages,
                1,
                m,
                repeats,
                **{'model.num_layers': LAYERS, 'model.remat': 'full', 'train.global_batch': m},
            )
            mib = CompiledStep(config).temp_bytes() / 2**20
            rows.append((stages, repeats, m, f'{mib:.1f}'))
    header = ('p', 'v', 'm', 'peak temporary MiB per device')
    print_table('Memory as micro-batches grow, 1 sequence per micro-batch', header, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/tiny.py')
    parser.add_argument('--steps', type=int, default=3)
    args = parser.parse_args()
    step_time_table(args.config, args.steps)
    bubble_table(args.config, args.steps)
    memory_table(args.config)


if __name__ == '__main__':
    main()
