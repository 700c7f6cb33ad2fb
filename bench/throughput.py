"""Throughput of a config on one device and on the 8-device layouts, measured in one process.

    python bench/throughput.py [--config configs/tiny.py] [--steps 5]

Columns: layout (data x stage x tensor), compile time (ahead of time, the whole jitted train
step), step time (median of --steps timed steps after one warm-up), tokens/s, and model
TFLOP/s per device (6N + 12LHQT per token). Same global batch and micro-step count everywhere,
so rows compare layouts, not batch sizes. On a CPU the 8 devices are simulated and share its
cores: the tensor-parallel rows measure the cost of the collectives, not a speed-up.
"""

import argparse
import math
import os
import statistics
import sys
import time

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtnlg_jax import config as config_lib  # noqa: E402
from mtnlg_jax import plan  # noqa: E402
from mtnlg_jax.parallel.mesh import make_mesh  # noqa: E402
from mtnlg_jax.train.state import init_state, make_setup  # noqa: E402
from mtnlg_jax.train.step import make_train_step, place_batch, to_micro_steps  # noqa: E402

LAYOUTS = [(1, 1, 1), (8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8)]


def measure(base, data, stage, tensor, steps):
    config = config_lib.load(base.path)
    micro_steps = base.micro_steps
    config.mesh.update(dict(data=data, stage=stage, tensor=tensor))
    config.train.micro_batch = config.train.global_batch // (data * micro_steps)
    devices = data * stage * tensor
    config = config_lib.resolve(config, devices)
    mesh = make_mesh(data, stage, tensor, devices=jax.devices()[:devices])
    setup = make_setup(config, mesh)
    rng = np.random.default_rng(0)
    shape = (config.train.global_batch, config.model.seq_len + 1)
    host_batch = rng.integers(0, config.model.vocab_size, shape).astype(np.int32)
    with jax.set_mesh(mesh):
        state = init_state(config, setup)
        batch = place_batch(*to_micro_steps(host_batch, config.train.micro_steps), mesh)
        start = time.perf_counter()
        train_step = make_train_step(config, setup).lower(state, *batch, jnp.float32(1)).compile()
        compile_s = time.perf_counter() - start
        state, metrics = train_step(state, *batch, jnp.float32(1))
        jax.block_until_ready(metrics)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = train_step(state, *batch, jnp.float32(1))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = math.prod(shape[:1]) * config.model.seq_len / step_s
    num_params = plan.count_params(setup.abstract_state['params'])
    tflops = plan.model_flops_per_token(config.model, num_params) * tokens_per_s / devices / 1e12
    return dict(
        layout=f'{data} x {stage} x {tensor}',
        devices=devices,
        micro_steps=config.train.micro_steps,
        compile_s=compile_s,
        step_s=step_s,
        tokens_per_s=tokens_per_s,
        tflops=tflops,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', dest='path', default='configs/tiny.py')
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--micro-steps', dest='micro_steps', type=int, default=2)
    args = parser.parse_args()

    rows = [measure(args, *layout, args.steps) for layout in LAYOUTS]
    print(f'command: python {" ".join(sys.argv)}')
    print(f'machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores, jax {jax.__version__}')
    header = '| data x stage x tensor | devices | micro-steps | compile s | step s | tokens/s | model TFLOP/s per device |'
    print(header)
    print('|' + '|'.join('---' for _ in header.split('|')[1:-1]) + '|')
    for row in rows:
        print(
            f'| {row["layout"]} | {row["devices"]} | {row["micro_steps"]} | {row["compile_s"]:.1f} '
            f'| {row["step_s"]:.3f} | {row["tokens_per_s"]:,.0f} | {row["tflops"]:.4f} |'
        )


if __name__ == '__main__':
    main()
