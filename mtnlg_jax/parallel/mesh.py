"""The device mesh: every axis of rules.MESH_AXES, outermost first, laid over the nodes.

    data      stage     expert      context      tensor
    outermost                                    innermost (a node's NVLink)

Axes are placed by the bytes each moves. Tensor parallelism moves the most (two all-reduces
per layer, forward and backward), so its axis is innermost: neighbouring devices of one node
(its NVLink domain) form a tensor group, and a tensor group never spans nodes (a config that
asks for it is a ConfigError). Context parallelism (sequence chunks) all-gathers keys and
values every layer: next to tensor. Expert parallelism sends each token to its experts' ranks
and back, an all-to-all per MoE layer: outside context. Pipeline stages exchange only the
activations at their boundary, so 'stage' crosses nodes; data-parallel replicas, one gradient
reduce-scatter per step, are outermost. Devices are ordered by (node, process, device id) and
reshaped, which is what `mesh_utils.create_hybrid_device_mesh` does with one granule per
node, where the node is the host (mtnlg_jax.run.distributed.node_of) rather than the process:
with one process per GPU, a node's eight processes share one tensor group. An axis of size 1
(expert and context, until a layer splits over them) leaves the layout as without it; the
pictures below leave them out.

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
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mtnlg_jax.config import ConfigError
from mtnlg_jax.parallel.rules import MESH_AXES
from mtnlg_jax.run import distributed


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


def axis_sizes(sizes=None, **by_name):
    """{axis: size} of every mesh axis, outermost first, from a dict and/or keywords
    (axis_sizes({'data': 2}, tensor=4)); an axis not named is 1. KeyError on a name that is
    not a mesh axis."""
    named = {**(sizes or {}), **by_name}
    unknown = sorted(set(named) - set(MESH_AXES))
    if unknown:
        raise KeyError(f'not mesh axes: {unknown} (the axes: {", ".join(MESH_AXES)})')
    return {axis: named.get(axis, 1) for axis in MESH_AXES}


def device_grid(sizes, devices, node_of=distributed.node_of):
    """The array of `devices` in topology order, one dimension per mesh axis (sizes: as
    axis_sizes takes them); ConfigError if a tensor group would span nodes."""
    sizes = axis_sizes(sizes)
    shape = tuple(sizes.values())
    if len(devices) != math.prod(shape):
        raise ValueError(f'{len(devices)} devices for a mesh of {" x ".join(map(str, shape))}')
    ordered = topology_order(devices, node_of)
    check_tensor_within_nodes(ordered, sizes['tensor'], node_of)
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered  # element-wise: a device object may itself be a sequence
    return grid.reshape(shape)


def make_mesh(sizes=None, devices=None, **by_name):
    """A mesh of every axis (MESH_AXES), sized by name as axis_sizes takes them
    (make_mesh({'data': 2, 'tensor': 4}) or make_mesh(data=2, tensor=4)), with Auto axes
    (with Explicit ones, annotated Flax matmuls fail to shard) over `devices` in topology
    order (default: the first devices of that order the mesh needs, so a smaller mesh than
    the machine, e.g. for evaluation, needs nothing more); ConfigError if tensor would span
    nodes. The one place a mesh is made."""
    sizes = axis_sizes(sizes, **by_name)
    if devices is None:
        devices = topology_order(jax.devices())[: math.prod(sizes.values())]
    return Mesh(
        device_grid(sizes, devices),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )


def mesh_from_config(config, devices=None):
    """The mesh of a resolved config (mesh.* already filled): every mesh.* key, over
    `devices` as make_mesh takes them."""
    return make_mesh({axis: config.mesh[axis] for axis in MESH_AXES}, devices)
