"""The device mesh: axes ('data', 'stage', 'tensor'), outermost first, laid over the nodes.

Tensor parallelism moves the most bytes, so its axis is innermost: neighbouring devices of
one node (its NVLink domain) form a tensor group, and a tensor group never spans nodes (a
config that asks for it is a ConfigError). Pipeline stages exchange the least, so 'stage'
crosses nodes; data-parallel replicas are outermost. Devices are ordered by (node, process,
device id) and reshaped, which is what `mesh_utils.create_hybrid_device_mesh` does with one
granule per node, where the node is the host (mtnlg_jax.run.distributed.node_of) rather than
the process: with one process per GPU, a node's eight processes share one tensor group.

    devices 0..7 of one node, data 2 x stage 2 x tensor 2:
        data 0: stage 0 [0 1]  stage 1 [2 3]
        data 1: stage 0 [4 5]  stage 1 [6 7]

    2 nodes x 4 devices (n0: a0..a3, n1: b0..b3), data 2 x stage 2 x tensor 2:
        data 0 = node 0: stage 0 [a0 a1]  stage 1 [a2 a3]
        data 1 = node 1: stage 0 [b0 b1]  stage 1 [b2 b3]
    the same nodes, data 1 x stage 2 x tensor 4:  stage 0 [a0..a3]  stage 1 [b0..b3]
    tensor 8 would join a0..a3 with b0..b3: refused.
"""

import collections

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mtnlg_jax.run import distributed
from mtnlg_jax.config import ConfigError

MESH_AXES = ('data', 'stage', 'tensor')


def topology_order(devices, node_of=distributed.node_of):
    """`devices` sorted by (node, process, id): each node's devices contiguous."""
    return sorted(devices, key=lambda d: (node_of(d), d.process_index, d.id))


def check_tensor_within_nodes(ordered, tensor, node_of=distributed.node_of):
    """ConfigError on mesh.tensor if a tensor group of `ordered` devices spans nodes."""
    for start in range(0, len(ordered), tensor):
        nodes = {node_of(d) for d in ordered[start : start + tensor]}
        if len(nodes) > 1:
            per_node = collections.Counter(node_of(d) for d in ordered)
            sizes = sorted(set(per_node.values()))
            raise ConfigError(
                'mesh.tensor',
                f'a tensor group of {tensor} devices would span nodes {sorted(nodes)} '
                f'({len(per_node)} nodes of {"/".join(map(str, sizes))} devices): tensor '
                f'parallelism stays inside a node, so mesh.tensor must divide the devices '
                f'of a node',
            )


def device_grid(data, stage, tensor, devices, node_of=distributed.node_of):
    """The (data, stage, tensor) array of `devices` in topology order; ConfigError if a
    tensor group would span nodes."""
    if len(devices) != data * stage * tensor:
        raise ValueError(f'{len(devices)} devices for a mesh of {data} x {stage} x {tensor}')
    ordered = topology_order(devices, node_of)
    check_tensor_within_nodes(ordered, tensor, node_of)
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered  # element-wise: a device object may itself be a sequence
    return grid.reshape(data, stage, tensor)


def make_mesh(data, stage, tensor, devices=None):
    """A mesh with Auto axes (with Explicit ones, annotated Flax matmuls fail to shard) over
    `devices` in topology order (default: the first data x stage x tensor devices in that
    order, so a smaller mesh than the machine, e.g. for evaluation, needs nothing more);
    ConfigError if tensor would span nodes. The one place a mesh is made."""
    if devices is None:
        devices = topology_order(jax.devices())[: data * stage * tensor]
    return Mesh(
        device_grid(data, stage, tensor, devices),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )


def mesh_from_config(config):
    """The mesh of a resolved config (mesh.* already filled)."""
    return make_mesh(config.mesh.data, config.mesh.stage, config.mesh.tensor)
