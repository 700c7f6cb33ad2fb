"""The train and eval steps launch/train.py runs, compiled ahead of time with nothing allocated.

    config -> mesh (first devices) -> make_setup (shapes and shardings, jax.eval_shape)
           -> ShapeDtypeStructs carrying the state's shardings + the abstract batch
           -> make_train_step(config, setup).lower(...).compile()

The same functions train.py calls (train/state.py, train/step.py, data/loader.py), so what is
measured here is what runs. On CPU the caller sets the forced device count (and, for a bf16
pipelined step, `--xla_disable_hlo_passes=all-reduce-promotion`) before JAX is imported:
launch/plan.py does.
"""

import math
import time

import jax
import jax.numpy as jnp

from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.config.keys import mesh_devices
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.train.state import make_setup
from mtnlg_jax.train.step import make_eval_step, make_train_step

# What a compile on forced CPU devices does differently from one on GPUs; launch/plan.py
# prints these next to the figures.
CPU_COMPILE_NOTES = (
    'compiled by XLA:CPU: the SPMD partitioner that places the collectives is the one GPU '
    'compiles use, but fusion, scheduling and buffer assignment are the CPU backend\'s',
    'the all-reduce-promotion pass is disabled (XLA:CPU aborts on a bf16 all-reduce inside '
    'the pipeline without it); a GPU compile runs it',
    'XLA:CPU computes a bf16 step in fp32 (its dots, their operand copies, its collectives): '
    'the compiled figures are compared with the plan of the fp32 step; on a GPU activations '
    'and collectives of a bf16 step take half of that',
    'XLA:CPU runs collectives synchronously (no -start/-done pairs); a GPU compile splits '
    'them to overlap communication with compute (the inventory counts a pair once)',
)


def gpu_compile_notes(target, flags):
    """What a GPU-target compile (plan/gpu_target.py) can and cannot know."""
    return (
        f'compiled by XLA:GPU for {target} on compile-only devices (no GPU): fusion, '
        f'scheduling and buffer assignment are the GPU backend\'s, but nothing ran, so no time '
        f'was measured, and autotuning was skipped (XLA\'s default GEMM and fusion choices)',
        'overlap: the compiled schedule replayed on the target\'s figures (plan/overlap.py): '
        'compute at peak FLOP/s and HBM bandwidth, ring collectives at the link bandwidths, '
        'no latency; exposed = time the compute stream waits at a collective\'s done',
        'XLA:GPU flags: '
        + (' '.join(f'--{flag}={value}' for flag, value in flags) or 'none of ours')
        + ' (mtnlg_jax/xla/flags.py; XLA_FLAGS of your own win)',
    )


def abstract_state(setup):
    """The train state as ShapeDtypeStructs carrying their shardings: nothing allocated."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        setup.abstract_state,
        setup.state_shardings,
    )


def layout(config, devices=None):
    """(mesh, setup) of a resolved config on the first devices its mesh covers."""
    count = mesh_devices(config.mesh)
    devices = jax.devices()[:count] if devices is None else devices
    if len(devices) < count:
        raise ValueError(
            f'the mesh needs {count} devices, {len(devices)} are available '
            f'(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={count})'
        )
    mesh = mesh_from_config(config, devices=devices)
    return mesh, make_setup(config, mesh)


def _compile(jitted, args, mesh, compiler_options=None):
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        lowered = jitted.lower(*args)
        lower_s = time.perf_counter() - start
        compiled = lowered.compile(compiler_options)
        compile_s = time.perf_counter() - start
    return compiled, lowered, dict(lower_s=lower_s, compile_s=compile_s)


def compile_train_step(config, micro_steps=None, devices=None, compiler_options=None):
    """The train step of a resolved config, compiled ahead of time on abstract inputs
    (compiler_options: XLA's debug options for this compile, e.g. plan/pgle.py's).

    Returns (compiled, lowered, info); info: mesh, setup, micro_steps, lower_s (tracing and
    lowering), compile_s (lowering and compiling: what train.py's banner reports)."""
    mesh, setup = layout(config, devices)
    micro_steps = micro_steps or config.train.micro_steps
    batch = loader_lib.abstract_train_batch(config, mesh, micro_steps)
    tokens_after_step = jax.ShapeDtypeStruct((), jnp.float32)
    compiled, lowered, times = _compile(
        make_train_step(config, setup),
        (abstract_state(setup), *batch, tokens_after_step),
        mesh,
        compiler_options,
    )
    return compiled, lowered, dict(mesh=mesh, setup=setup, micro_steps=micro_steps, **times)


def compile_eval_step(config, micro_steps=None, devices=None):
    """The eval step (launch/train.py's validation), compiled as compile_train_step does."""
    mesh, setup = layout(config, devices)
    micro_steps = micro_steps or config.train.micro_steps
    state = abstract_state(setup)
    tokens, _ = loader_lib.abstract_train_batch(config, mesh, micro_steps)
    buffers = (state['buffers'],) if 'buffers' in state else ()  # an MoE's router bias
    args = (state['params'], tokens, *buffers)
    compiled, lowered, times = _compile(make_eval_step(config, setup), args, mesh)
    return compiled, lowered, dict(mesh=mesh, setup=setup, micro_steps=micro_steps, **times)


def memory(compiled):
    """Bytes per device from XLA's memory analysis; peak = arguments + outputs - aliased
    outputs + temporaries (a donated state's outputs live in its arguments' buffers)."""
    stats = compiled.memory_analysis()
    out = dict(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
    )
    out['peak_bytes'] = (
        out['argument_bytes'] + out['output_bytes'] - out['alias_bytes'] + out['temp_bytes']
    )
    return out


def flops(compiled):
    """FLOPs per device of one run, from XLA's cost analysis (None if it gives none)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    value = (analysis or {}).get('flops')
    return None if value is None or math.isnan(value) else float(value)
