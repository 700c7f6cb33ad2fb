"""bench/gpu_check.py's collectives section: the MoE exchange's all-to-all (and its ragged
form) beside all-gather and reduce-scatter, timed over every GPU of the machine.

    collectives(sizes_mib=(1, 16, 128))   one row per (collective, MiB a GPU sends or holds):
                                          median ms, algorithm and bus bandwidth in GB/s

Bandwidths follow nccl-tests' conventions, so the rows read beside `all_to_all_perf` and
friends: S is the bytes each GPU holds in (all-to-all, reduce-scatter) or out (all-gather),
n the GPUs; algorithm bandwidth S / t, bus bandwidth S / t x (n - 1) / n, what each link
carries and what the planner's ring model charges (plan/comm.py). The ragged all-to-all
sends every peer an equal share, so it measures the primitive's cost over the dense one;
the MoE's real sizes vary with the routing. One GPU has no peer: the section says so.
"""

import jax
import jax.numpy as jnp
import numpy as np
from gpu_check_kernels import median_ms
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

KINDS = ('all_to_all', 'ragged_all_to_all', 'all_gather', 'reduce_scatter')


def _program(kind, n):
    """Each GPU's (rows, 128) bf16 block -> the collective's result, per device."""

    def body(x):
        if kind == 'all_to_all':
            return jax.lax.all_to_all(x, 'x', 0, 0, tiled=True)
        if kind == 'all_gather':
            return jax.lax.all_gather(x, 'x', tiled=True)
        if kind == 'reduce_scatter':
            return jax.lax.psum_scatter(x, 'x', tiled=True)
        share = x.shape[0] // n
        offsets = jnp.arange(n, dtype=jnp.int32) * share
        sizes = jnp.full((n,), share, jnp.int32)
        here = jax.lax.axis_index('x') * share  # where this GPU's rows land on each peer
        return jax.lax.ragged_all_to_all(
            x, jnp.zeros_like(x), offsets, sizes, jnp.full((n,), here, jnp.int32), sizes,
            axis_name='x',
        )  # fmt: skip

    return body


def _expected(kind, blocks):
    """The collective's result, per device, from every device's block (n, rows, 128)."""
    n = blocks.shape[0]
    chunks = blocks.reshape(n, n, -1, 128)  # [device, chunk]
    if kind == 'all_gather':
        return np.broadcast_to(blocks.reshape(1, -1, 128), (n, n * blocks.shape[1], 128))
    if kind == 'reduce_scatter':
        return chunks.sum(0)
    return chunks.transpose(1, 0, 2, 3).reshape(blocks.shape)  # chunk d of each to device d


def _row(kind, mib, devices):
    n = len(devices)
    rows = max(n, mib * 2**20 // (128 * 2) // n * n)  # bf16 (rows, 128), rows a multiple of n
    mesh = Mesh(np.array(devices), ('x',))
    spec = P('x')
    # each chunk of rows / n rows its own small integer (exact in bf16, and their sums: <= 248)
    chunk = (np.arange(n * rows) // (rows // n)) % 32
    blocks = np.broadcast_to(chunk[:, None], (n * rows, 128)).astype(np.float32)
    x = jax.device_put(jnp.asarray(blocks, jnp.bfloat16), NamedSharding(mesh, spec))
    step = jax.jit(jax.shard_map(_program(kind, n), mesh=mesh, in_specs=spec, out_specs=spec))
    got = np.asarray(step(x), np.float32).reshape(n, -1, 128)
    want = _expected(kind, blocks.reshape(n, rows, 128)).reshape(n, -1, 128)
    held = rows * 128 * 2 * (n if kind == 'all_gather' else 1)
    ms = median_ms(step, x)
    algorithm = held / ms / 1e6
    return dict(
        collective=kind,
        mib=round(rows * 128 * 2 / 2**20, 1),
        agrees=bool(np.array_equal(got, want)),  # small integers: exact in bf16, sums too
        ms=round(ms, 3),
        algorithm_gb_s=round(algorithm, 3),
        bus_gb_s=round(algorithm * (n - 1) / n, 3),
    )


def collectives(sizes_mib=(1, 16, 128), kinds=KINDS, devices=None):
    """The collectives section over `devices` (default: every local GPU)."""
    devices = list(devices if devices is not None else jax.local_devices())
    if len(devices) < 2:
        return dict(skipped=f'needs two or more GPUs: {len(devices)} here', rows=[])
    rows = []
    for kind, mib in ((kind, mib) for kind in kinds for mib in sizes_mib):
        try:
            rows.append(_row(kind, mib, devices))
        except Exception as error:  # noqa: BLE001 -- a collective XLA refuses is a finding
            message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ''
            rows.append(dict(collective=kind, mib=mib, error=f'{type(error).__name__}: {message}'))
    return dict(devices=f'{len(devices)} x {devices[0].device_kind}', rows=rows)
