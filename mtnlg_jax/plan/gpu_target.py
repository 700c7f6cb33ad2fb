"""Compile-only NVIDIA GPUs: XLA:GPU as the measuring instrument, on a machine without a GPU.

    target name ('a100-80gb')  ->  targets/a100_sxm_80.txtpb (a GpuTargetConfigProto: SM count,
                                   shared memory, HBM bandwidth, L2, clock, compute capability)
                               ->  jax.experimental.topologies.get_topology_desc(platform='cuda',
                                   topology='1 x NODES x GPUS_PER_NODE', target_config=...)
                               ->  compile-only devices (process index = node), as many as the
                                   layout needs: 2,240 for MT-NLG, in one process

mtnlg_jax/xla/gpu_compile.py makes the compiler ready before JAX starts (prepare_environment).
Nothing is allocated or run, so a GPU compile times nothing, and XLA skips autotuning (it takes
its default GEMM and fusion configurations rather than the fastest measured ones).
"""

import contextlib
import os
import re

from mtnlg_jax.config.keys import mesh_devices
from mtnlg_jax.xla.gpu_compile import TARGETS

TARGET_FILES = {'a100-80gb': 'a100_sxm_80.txtpb', 'h100-80gb': 'h100_sxm.txtpb'}
# An H200 is the H100's chip (its SMs, clocks and caches) with more and faster memory: 4.8 TB/s
# (the datasheet) and 143,771 MiB (what nvidia-smi reports on one).
DERIVED = {
    'h200-141gb': ('h100-80gb', dict(memory_bandwidth=4_800_000_000_000,
                                     device_memory_size=143_771 * 2**20)),
}  # fmt: skip
assert set(TARGET_FILES) | set(DERIVED) == set(TARGETS)


def target_config(target):
    """The GpuTargetConfigProto text of a target name (KeyError if unknown)."""
    base, fields = DERIVED.get(target, (target, {}))
    path = os.path.join(os.path.dirname(__file__), 'targets', TARGET_FILES[base])
    with open(path) as f:
        text = f.read()
    for field, value in fields.items():
        text, found = re.subn(rf'^(  {field}: )\d+$', rf'\g<1>{value}', text, flags=re.M)
        assert found == 1, (target, field)
    return text


def devices(target, count, gpus_per_node=8):
    """`count` compile-only devices of `target`, on count / gpus_per_node nodes (one node of
    `count` when fewer); each node's devices share a process index."""
    from jax.experimental import topologies  # noqa: PLC0415

    per_node = min(count, gpus_per_node)
    if count % per_node:
        raise ValueError(f'{count} devices do not fill nodes of {gpus_per_node} GPUs')
    topology = topologies.get_topology_desc(
        platform='cuda',
        topology_name=target,
        topology=f'1x{count // per_node}x{per_node}',
        target_config=target_config(target),
    )
    return list(topology.devices)


@contextlib.contextmanager
def compiling_for(devices):
    """Trace for compile-only `devices`: JAX's cuDNN attention asks the local GPU backend for
    the compute capability (for the head dimensions it allows: 128 before Hopper, 256 from
    it); here there is none, so the target's devices answer instead."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415

    have = tuple(int(x) for x in str(devices[0].compute_capability).split('.'))

    def at_least(capability):
        return have >= tuple(int(x) for x in capability.split('.'))

    def equal(capability):
        return have == tuple(int(x) for x in capability.split('.'))

    saved = cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal
    cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal = at_least, equal
    try:
        yield
    finally:
        cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal = saved


def compile_train_step(config, target, gpus_per_node=8, compiler_options=None):
    """(compiled, info) of `config`'s train step compiled by XLA:GPU for as many compile-only
    `target` devices as its mesh has (plan/compile.py's compile_train_step on them)."""
    from mtnlg_jax.plan import compile as compile_lib  # noqa: PLC0415 (imports JAX)

    found = devices(target, mesh_devices(config.mesh), gpus_per_node)
    with compiling_for(found):
        compiled, _, info = compile_lib.compile_train_step(
            config, devices=found, compiler_options=compiler_options
        )
    return compiled, info
