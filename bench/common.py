"""What the benchmarks share: a config under a layout, its compiled train step, timed steps."""

import os
import statistics
import sys
import time

if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (
        os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtnlg_jax import config as config_lib  # noqa: E402
from mtnlg_jax.config import keys  # noqa: E402
from mtnlg_jax.parallel.mesh import mesh_from_config  # noqa: E402
from mtnlg_jax.train.state import init_state, make_setup  # noqa: E402
from mtnlg_jax.data.batch import place_batch, to_micro_steps  # noqa: E402
from mtnlg_jax.train.step import make_train_step  # noqa: E402


def layout_config(path, data, stage, tensor, micro_steps, repeats=1, **overrides):
    """The config file's config under a layout, with `micro_steps` micro-batches per step
    (global_batch kept); overrides are (section, key) -> value pairs as 'section.key'."""
    config = config_lib.load(path)
    config.train.rampup.start = 0  # a benchmark times one batch size
    config.mesh.update(dict(data=data, stage=stage, tensor=tensor))
    config.pipeline.repeats = repeats
    for dotted, value in overrides.items():
        section, key = dotted.split('.')
        config[section][key] = value
    config.train.micro_batch = config.train.global_batch // (data * micro_steps)
    return config_lib.resolve(config, data * stage * tensor)


def own_layout_config(path):
    """The config file's config under its own mesh and micro-batch, one batch size."""
    config = config_lib.load(path)
    config.train.rampup.start = 0
    return config_lib.resolve(config, keys.mesh_devices(config.mesh))


class CompiledStep:
    """A config's train step compiled ahead of time on the first devices, with its state."""

    def __init__(self, config):
        self.config = config
        self.mesh = mesh_from_config(config)
        self.setup = make_setup(config, self.mesh)
        rng = np.random.default_rng(0)
        shape = (config.train.global_batch, config.model.seq_len + 1)
        host_batch = rng.integers(0, config.model.vocab_size, shape).astype(np.int32)
        with jax.set_mesh(self.mesh):
            self.state = init_state(config, self.setup)
            self.batch = place_batch(
                *to_micro_steps(host_batch, config.train.micro_steps), self.mesh
            )
            start = time.perf_counter()
            lowered = make_train_step(config, self.setup).lower(
                self.state, *self.batch, jnp.float32(1)
            )
            self.compiled = lowered.compile()
            self.compile_s = time.perf_counter() - start

    def temp_bytes(self):
        """Peak temporary memory of one device (XLA's memory analysis of the step)."""
        return self.compiled.memory_analysis().temp_size_in_bytes

    def step_times(self, steps, warmup=1):
        """Wall times of `steps` steps, after `warmup` untimed ones."""
        times = []
        with jax.set_mesh(self.mesh):
            for i in range(warmup + steps):
                start = time.perf_counter()
                self.state, metrics = self.compiled(self.state, *self.batch, jnp.float32(1))
                jax.block_until_ready(metrics)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
        return times

    def step_seconds(self, steps):
        """Median wall time of `steps` steps after one warm-up step."""
        return statistics.median(self.step_times(steps))


def cpu_model():
    """The host CPU's model name (/proc/cpuinfo), so figures from different machines are not
    compared by mistake."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return 'unknown CPU'


def print_table(title, header, rows):
    """A markdown table with the command that made it and the machine it ran on."""
    print(f'\n{title}')
    print(f'command: python {" ".join(sys.argv)}')
    print(
        f'machine: {jax.devices()[0].device_kind} ({cpu_model()}), {os.cpu_count()} cores, '
        f'jax {jax.__version__}'
    )
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '|'.join('---' for _ in header) + '|')
    for row in rows:
        print('| ' + ' | '.join(str(cell) for cell in row) + ' |')


def compile_for_one_h100(fn, shapes, compiler_options=None):
    """fn compiled by XLA:GPU for one compile-only H100 (`make gpu-compile`, enabled before JAX
    started) on arrays of `shapes`, (shape, dtype) pairs: the optimized program, nothing run.
    compiler_options: jax.jit's (e.g. model/fp8.py's)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    from mtnlg_jax.plan import gpu_target  # noqa: PLC0415

    devices = gpu_target.devices('h100-80gb', 1)
    whole = NamedSharding(Mesh(devices, ('x',)), PartitionSpec())
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=whole) for shape, dtype in shapes]
    with gpu_target.compiling_for(devices):
        return jax.jit(fn, compiler_options=compiler_options).lower(*specs).compile()
