"""The device mesh: axes ('data', 'stage', 'tensor'), outermost first.

Tensor parallelism moves the most bytes, so its axis is innermost: neighbouring devices (one
node's NVLink domain) form a tensor group. Pipeline stages exchange the least, so 'stage'
sits between; data parallel replicas are outermost.

    devices 0..7, data 2 x stage 2 x tensor 2:
        data 0: stage 0 [0 1]  stage 1 [2 3]
        data 1: stage 0 [4 5]  stage 1 [6 7]
"""

import jax
from jax.sharding import AxisType

MESH_AXES = ('data', 'stage', 'tensor')


def make_mesh(data, stage, tensor, devices=None):
    """A mesh with Auto axes (with Explicit ones, annotated Flax matmuls fail to shard)."""
    devices = jax.devices() if devices is None else devices
    return jax.make_mesh(
        (data, stage, tensor),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def mesh_from_config(config):
    """The mesh of a resolved config (mesh.* already filled)."""
    return make_mesh(config.mesh.data, config.mesh.stage, config.mesh.tensor)
