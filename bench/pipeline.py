"""The pipeline schedules: step time against the other layouts, bubble, memory.

    python bench/pipeline.py [--config configs/tiny.py] [--steps 3] [--tables time,bubble,memory]
                             [--schedules 1f1b,zbh1]   (default: all of SCHEDULES)
                             [--stages 4]              (memory: default p = 2 and 4)

Three tables (and a fourth on request), all from one run on the same 8 devices, for each
`pipeline.schedule`:

1. Step time of data 2 x stage 2 x tensor 2 (v = 1 and 2) against data 8 and data 4 x
   tensor 2, same global batch, as ratios to data 8. On a CPU the 8 devices are simulated
   on shared cores, so stages do not run at the same time: the ratio shows what the schedule
   adds (recompute, hand-offs, bubble work), not a speed-up.
2. Measured against predicted bubble fraction, p = 2 and 4. Measured: step time T grows with
   the number of micro-batches m as T = c + w m at fixed micro-batch size; w / v is one
   chunk's forward and backward, the p - 1 ticks of ramp cost (p - 1) w / v, so the measured
   bubble is (p - 1) (w / v) / T(m). Predicted: (p - 1) / (v m + p - 1) for gpipe, the
   table's (parallel/schedule.py) for 1f1b / interleaved. On a CPU a waiting stage costs no
   time (the simulated devices share the cores): the 1F1B engine skips idle slots, GPipe's
   scan computes on zeros, so only GPipe's measured figure means anything here.
3. Peak temporary memory per device (XLA's memory analysis of the compiled train step) as m
   grows, at fixed micro-batch size: GPipe order keeps every micro-batch's stage inputs
   (v m + p - 1), 1F1B-family schedules at most the table's in-flight count, whatever m.

    python bench/pipeline.py --tables schedule

   (arithmetic only) the tables' bubble against m at p = 4 and 16, each schedule beside its
   formula: 1F1B's (p - 1) / (v m + p - 1), ZB-H1's (p - 1) / (3 m), ZB-V's (p - 1) /
   (6 m + p - 1) (its start-up), and the most micro-batches a stage holds (its memory in chunk
   residuals: a zbv or interleaved chunk is half a stage).

    python bench/pipeline.py --tables inflight

   (arithmetic only) 1f1b's table against the same bounded by pipeline.max_in_flight = p:
   stage inputs held, ticks and predicted bubble; interleaved at Llama 3 405B's shape (p 16,
   v 4, m 32) under several bounds, beside the steady-state bubble Little's law gives a
   lockstep table and the unbounded table's time plus an F + B per chunk input held less.

    python bench/pipeline.py --tables flops [--schedules 1f1b,zbh1]

   compiled matmul FLOPs over the model's (the plan's HLO inventory, each conditional's
   branches weighted by the table) of data 2 x stage 2 x tensor 2 against stage 1, 4 layers,
   hidden 128, m = 4, no recompute: a schedule that recomputes shows above stage 1's (ZB-H1's
   W before it took its taps from B: 1.5 x).

    python bench/pipeline.py --tables replayed     (`make gpu-compile` first)

   each 1f1b-family schedule's table bubble beside the idle share of its compiled step
   (XLA:GPU for H100s, compile-only, p = 4, m = 8), every tick priced at its slowest stage
   (plan/lockstep.py).

    python bench/pipeline.py --scale [--micro_batches 240]

4. (--scale, alone: 280 CPU devices) configs/mtnlg_530b.py's train step, one replica (tensor
   8 x stage 35, data 1), m = 240 micro-batches of 1 sequence (its data-8 share of 1920), 1F1B,
   full recompute, bf16, compiled on forced CPU devices with nothing allocated: XLA's memory
   analysis per device. Data 8 with ZeRO-1 splits the fp32 master copy and Adam moments 8
   ways: added by arithmetic (7/8 of them taken off), until several processes can compile
   data 8.
"""

import argparse
import os
import sys

SCALE_DEVICES = 280  # one MT-NLG replica: tensor 8 x stage 35
if '--scale' in sys.argv:  # before JAX is imported (bench/common.py imports it)
    os.environ['XLA_FLAGS'] = (
        os.environ.get('XLA_FLAGS', '')
        + f' --xla_force_host_platform_device_count={SCALE_DEVICES}'
        + ' --xla_disable_hlo_passes=all-reduce-promotion'  # XLA:CPU, bf16 all-reduce
    )

import numpy as np  # noqa: E402
from common import CompiledStep, layout_config, print_table  # noqa: E402

from mtnlg_jax.parallel import pipeline, zero_bubble_v  # noqa: E402

LAYERS = 8  # divisible by p x v = 8


SCHEDULES = [('gpipe', 1), ('gpipe', 2), ('1f1b', 1), ('interleaved', 2), ('zbh1', 1), ('zbv', 2)]


def step_time_table(path, steps):
    layouts = [('data 8', 8, 1, 1, 1, '1f1b'), ('data 4 x tensor 2', 4, 1, 2, 1, '1f1b')]
    layouts += [
        (f'data 2 x stage 2 x tensor 2, {schedule}, v = {repeats}', 2, 2, 2, repeats, schedule)
        for schedule, repeats in SCHEDULES
    ]
    rows, base = [], None
    for name, data, stage, tensor, repeats, schedule in layouts:
        micro_steps = 4 if stage > 1 else 2  # same global batch: 16 = mb x data x m
        config = layout_config(
            path,
            data,
            stage,
            tensor,
            micro_steps,
            repeats,
            **{'model.num_layers': LAYERS, 'model.remat': 'full', 'pipeline.schedule': schedule},
        )
        seconds = CompiledStep(config).step_seconds(steps)
        base = base or seconds
        bubble = pipeline.bubble_fraction(stage, repeats, config.train.micro_steps, schedule)
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


def stage_only_config(path, stages, repeats, micro, schedule):
    """Mesh stage only, m micro-batches of 1 sequence, full recompute."""
    overrides = {
        'model.num_layers': LAYERS,
        'model.remat': 'full',
        'train.global_batch': micro,
        'pipeline.schedule': schedule,
    }
    return layout_config(path, 1, stages, 1, micro, repeats, **overrides)


def bubble_table(path, steps):
    rows = []
    for schedule, repeats in SCHEDULES:
        for stages in (2, 4):
            micro = [4, 8, 16]
            times = []
            for m in micro:
                config = stage_only_config(path, stages, repeats, m, schedule)
                times.append(CompiledStep(config).step_seconds(steps))
            slope, _ = np.polyfit(micro, times, 1)
            for m, seconds in zip(micro, times):
                measured = (stages - 1) * slope / repeats / seconds
                predicted = pipeline.bubble_fraction(stages, repeats, m, schedule)
                rows.append(
                    (
                        schedule,
                        stages,
                        repeats,
                        m,
                        f'{seconds:.3f}',
                        f'{measured:.3f}',
                        f'{predicted:.3f}',
                    )
                )
    header = ('schedule', 'p', 'v', 'm', 'step s', 'measured bubble', 'predicted')
    print_table('Bubble fraction, 1 sequence per micro-batch, stage only', header, rows)


def memory_table(path, stage_counts=(2, 4)):
    rows = []
    for schedule, repeats in SCHEDULES:
        for stages in stage_counts:
            cells = []
            for m in (4, 8, 16, 32):
                if schedule == 'gpipe' and repeats > 1 and m < stages:
                    cells.append('n/a')
                    continue
                config = stage_only_config(path, stages, repeats, m, schedule)
                cells.append(f'{CompiledStep(config).temp_bytes() / 2**20:.1f}')
            rows.append((schedule, stages, repeats, *cells))
    header = ('schedule', 'p', 'v', 'm = 4', 'm = 8', 'm = 16', 'm = 32')
    print_table(
        'Peak temporary MiB per device of the compiled train step, 1 sequence per micro-batch',
        header,
        rows,
    )


def schedule_table():
    """The tables' bubble (F = 1, B + W = 2) and stage inputs held against m, p = 4 and 16."""
    rows = []
    for stages in (4, 16):
        for schedule, repeats in [s for s in SCHEDULES if s[0] != 'gpipe']:
            for micro in (4, 8, 16, 32, 64):
                table = pipeline.build_table(stages, repeats, micro, schedule=schedule)
                formula = (stages - 1) / (repeats * micro + stages - 1)
                if schedule == 'zbh1':
                    formula = (stages - 1) / (3 * micro)
                if schedule == 'zbv':  # ZB-V's own count, its start-up included
                    formula = zero_bubble_v.ideal_bubble(stages, micro)
                bubble = table.bubble_fraction()
                cells = (f'{bubble:.3f}', f'{formula:.3f}', table.in_flight().max(), table.ticks)
                rows.append((schedule, stages, repeats, micro, *cells))
    header = ('schedule', 'p', 'v', 'm', 'table bubble', 'formula', 'held (max)', 'ticks')
    print_table('Bubble counted from each table, against its formula', header, rows)


def in_flight_table():
    """The lockstep tables against the same bounded by pipeline.max_in_flight (arithmetic
    only): 1f1b bounded to p stage inputs, and interleaved at Llama 3 405B's shape (p 16, v 4,
    m 32) under several bounds, beside the bubble Little's law gives (`steady_bubble`)."""
    rows = []
    for stages, micro in ((4, 16), (4, 64), (8, 64), (35, 240)):
        greedy = pipeline.build_table(stages, 1, micro)
        bounded = pipeline.build_table(stages, 1, micro, max_in_flight=stages)
        rows.append(
            (
                stages,
                micro,
                greedy.in_flight().max(),
                bounded.in_flight().max(),
                greedy.ticks,
                bounded.ticks,
                f'{greedy.bubble_fraction():.3f}',
                f'{bounded.bubble_fraction():.3f}',
            )
        )
    header = (
        'p', 'm', 'in flight (no bound)', 'in flight (bound p)', 'ticks (no bound)',
        'ticks (bound p)', 'bubble (no bound)', 'bubble (bound p)',
    )  # fmt: skip
    print_table(
        '1f1b: stage inputs held by stage 0, without and with max_in_flight = p', header, rows
    )
    stages, repeats, micro = 16, 4, 32
    free = pipeline.build_table(stages, repeats, micro)
    rows = []
    for bound in (None, 8, 12, 16, 17, 18, 19, 20, 24):
        table = pipeline.build_table(stages, repeats, micro, max_in_flight=bound)
        held = table.in_flight().max()
        rows.append(
            (
                bound or 'none',
                held,
                table.ticks,
                f'{table.bubble_fraction():.3f}',
                f'{steady_bubble(stages, repeats, held):.3f}',
                f'{ramped_bubble(free, held):.3f}',
            )
        )
    header = (
        'max_in_flight', 'chunk inputs held (max)', 'ticks', 'bubble', "Little's law",
        'unbounded + F + B a chunk less',
    )  # fmt: skip
    print_table(
        f'interleaved, p = {stages}, v = {repeats}, m = {micro} (Llama 3 405B): the bound '
        'against the bubble',
        header,
        rows,
    )


def ramped_bubble(free, held, forward=1.0, backward=2.0):
    """The bubble of the unbounded table `free` with a stage-0 tick of F + B added per chunk
    input held below its count (the lowest a search over the interleaved table's admission
    ticks found, docs/benchmarks.md): its ramps, which Little's law leaves out, and the cost
    of holding less."""
    time, work = free.tick_costs(forward, backward)
    extra = (forward + backward) * max(0, free.in_flight().max() - held)
    return 1.0 - work.max() / (time.sum() + extra)


def steady_bubble(stages, repeats, held):
    """The steady state's bubble in a lockstep interleaved table whose stage 0 holds `held`
    chunk inputs (an estimate: the ramps and the tick's F + B pricing aside): each hop takes a
    tick, so chunk j of stage 0 (global chunk j p) waits 2 (p v - 1 - j p) ticks for its
    backward, p v + p - 2 on average over its v chunks; one forward a tick keeps that many
    held (Little's law), and with fewer the steady state runs at held / that of its rate."""
    return max(0.0, 1.0 - held / (stages * repeats + stages - 2))


def replayed_table(path, target='h100-80gb', stages=4, micro=8):
    """Each 1F1B-family schedule's bubble counted from its table beside the compiled step's
    idle time: `launch/plan.py --target` (XLA:GPU, compile-only) on data 1 x stage p x tensor
    2, 8 layers, m micro-batches of 1 sequence, its `lockstep` figures (plan/lockstep.py):
    the loop's ticks each at its slowest stage, and the share of it the bubble takes."""
    import json
    import subprocess
    import tempfile

    rows = []
    for schedule, repeats in [s for s in SCHEDULES if s[0] != 'gpipe']:
        table = pipeline.build_table(stages, repeats, micro, schedule=schedule)
        overrides = {
            'mesh.data': 1, 'mesh.stage': stages, 'mesh.tensor': 2, 'model.num_layers': LAYERS,
            'pipeline.schedule': schedule, 'pipeline.repeats': repeats,
            'train.micro_batch': 1, 'train.global_batch': micro, 'train.rampup.start': 0,
        }  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, 'plan.json')
            flags = [f'--config.{key}={value}' for key, value in overrides.items()]
            command = [sys.executable, 'launch/plan.py', '--config', path, '--target', target,
                       '--compile', '--json', out, *flags]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True)
            ticks = json.load(open(out))['compiled']['overlap']['lockstep']
        rows.append(
            (
                schedule,
                repeats,
                table.ticks,
                f'{table.bubble_fraction():.3f}',
                f'{ticks["bubble_s"] / ticks["lockstep_loop_s"]:.3f}',
                f'{1e3 * ticks["lockstep_loop_s"]:.3f}',
            )
        )
    header = ('schedule', 'v', 'ticks', 'table bubble (F 1, B 2)', 'replayed idle share',
              'replayed loop ms')  # fmt: skip
    print_table(
        f'The table\'s bubble beside the compiled step\'s idle time: p = {stages}, m = {micro}, '
        f'{target} (compile-only)',
        header,
        rows,
    )


def flops_table(path):
    """Compiled matmul FLOPs over the model's, stage 1 and each schedule (module docstring)."""
    from mtnlg_jax.plan import compile as compile_lib
    from mtnlg_jax.plan import report

    layouts = [('stage 1 (data 2 x tensor 2)', 1, 1, '1f1b')]
    layouts += [(f'{schedule}, v = {v}', 2, v, schedule) for schedule, v in SCHEDULES]
    rows = []
    for name, stages, repeats, schedule in layouts:
        overrides = {'model.num_layers': 4, 'model.hidden': 128, 'model.remat': 'none'}
        overrides['pipeline.schedule'] = schedule
        config = layout_config(path, 2, stages, 2, 4, repeats, **overrides)
        compiled, _, info = compile_lib.compile_train_step(config)
        plan = report.add_compiled(report.make_plan(config), config, compiled, info)
        rows.append((name, f'{plan["compiled"]["flops_vs_model"]:.4f}'))
    print_table(
        'Compiled matmul FLOPs / model FLOPs, data 2 x stage 2 x tensor 2, m = 4, no recompute',
        ('layout', 'compiled / model'),
        rows,
    )


def scale_table(micro_batches):
    from mtnlg_jax import config as config_lib
    from mtnlg_jax.parallel import footprint
    from mtnlg_jax.plan import compile as compile_lib

    config = config_lib.load('configs/mtnlg_530b.py')
    config.mesh.update(dict(data=1, stage=35, tensor=8))
    config.train.update(dict(global_batch=micro_batches, micro_batch=1))
    config.train.rampup.start = 0
    config.pipeline.schedule = '1f1b'
    config = config_lib.resolve(config, SCALE_DEVICES)
    compiled, _, info = compile_lib.compile_train_step(config)
    memory = compile_lib.memory(compiled)
    held = footprint.bytes_per_device(config, info['setup'])
    zero_share = held['optimizer'] * 7 // 8  # data 8: master + moments split 8 ways
    gib = lambda n: f'{n / 2**30:.1f}'  # noqa: E731
    rows = [
        (
            'arguments (state: bf16 copy not included; fp32 master + moments, data 1)',
            gib(memory['argument_bytes']),
        ),
        ('outputs - aliased (donated state)', gib(memory['output_bytes'] - memory['alias_bytes'])),
        ('temporaries', gib(memory['temp_bytes'])),
        ('peak, one replica (data 1)', gib(memory['peak_bytes'])),
        ('ZeRO-1 over data 8: 7/8 of master + moments off (arithmetic)', f'-{gib(zero_share)}'),
        ('peak per device, data 8', gib(memory['peak_bytes'] - zero_share)),
        ('compile s', f'{info["compile_s"]:.0f}'),
    ]
    print_table(
        f'mtnlg_530b train step, tensor 8 x stage 35, m = {micro_batches}, 1F1B, full recompute, '
        f'bf16, {config.pipeline.schedule} table of '
        f'{pipeline.num_ticks(35, 1, micro_batches)} ticks: GiB per device',
        ('', 'GiB'),
        rows,
    )
    for note in compile_lib.CPU_COMPILE_NOTES:
        print(f'- {note}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/tiny.py')
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--tables', default='time,bubble,memory')
    parser.add_argument('--scale', action='store_true')
    parser.add_argument('--micro_batches', type=int, default=240)
    parser.add_argument('--schedules', default='', help='comma-separated: only these')
    parser.add_argument('--stages', default='2,4', help='memory table: these p')
    args = parser.parse_args()
    if args.schedules:
        SCHEDULES[:] = [s for s in SCHEDULES if s[0] in args.schedules.split(',')]
    if args.scale:
        scale_table(args.micro_batches)
        return
    tables = args.tables.split(',')
    if 'time' in tables:
        step_time_table(args.config, args.steps)
    if 'bubble' in tables:
        bubble_table(args.config, args.steps)
    if 'memory' in tables:
        memory_table(args.config, tuple(int(p) for p in args.stages.split(',')))
    if 'inflight' in tables:
        in_flight_table()
    if 'schedule' in tables:
        schedule_table()
    if 'flops' in tables:
        flops_table(args.config)
    if 'replayed' in tables:
        replayed_table(args.config)


if __name__ == '__main__':
    main()
