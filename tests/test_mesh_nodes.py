"""The mesh over nodes (no processes started): devices laid out by (node, process, device id),
tensor groups inside a node, data outermost; a tensor group across nodes is refused."""

import collections

import numpy as np
import pytest

Device = collections.namedtuple('Device', 'id process_index')


def simulated_devices(nodes, processes_per_node, devices_per_process, cyclic=False):
    """Devices of a multi-process run as JAX numbers them (process p's from p x 2048), in a
    shuffled order, and the node of each: processes 0, 1, .. fill node 0 first, or with
    `cyclic` (SLURM's --distribution=cyclic) go round the nodes."""
    per_node = processes_per_node * devices_per_process
    devices = [
        Device(process * 2048 + k, process)
        for process in range(nodes * processes_per_node)
        for k in range(devices_per_process)
    ]
    order = np.random.default_rng(0).permutation(len(devices))
    node = {
        d: d.process_index % nodes if cyclic else d.process_index // processes_per_node
        for d in devices
    }
    return [devices[i] for i in order], node.__getitem__, per_node


@pytest.mark.parametrize(
    'nodes, processes_per_node, devices_per_process, cyclic, data, stage, tensor',
    [
        (2, 2, 2, False, 2, 2, 2),  # 2 nodes, 2 processes of 2 devices each
        (2, 4, 1, True, 1, 2, 4),  # one process per device, placed round the nodes
        (2, 1, 4, False, 1, 4, 2),  # stage crosses the nodes
        (280, 8, 1, False, 8, 35, 8),  # MT-NLG 530B: 280 DGX nodes, one process per GPU
    ],
)
def test_mesh_keeps_tensor_in_a_node_and_data_outermost(
    nodes, processes_per_node, devices_per_process, cyclic, data, stage, tensor
):
    from mtnlg_jax.parallel.mesh import device_grid

    devices, node_of, per_node = simulated_devices(
        nodes, processes_per_node, devices_per_process, cyclic
    )
    grid = device_grid(dict(data=data, stage=stage, tensor=tensor), devices, node_of)
    assert sorted(d.id for d in grid.ravel()) == sorted(d.id for d in devices)
    nodes_of = np.vectorize(node_of)(grid)
    # A tensor group is one node, each node's devices contiguous; stage, then data, outer.
    assert (nodes_of == nodes_of[..., :1]).all()
    flat = nodes_of.reshape(-1)
    np.testing.assert_array_equal(flat, np.arange(len(flat)) // per_node)
    ids = np.vectorize(lambda d: d.id)(grid).reshape(-1, per_node)
    assert (np.diff(ids, axis=1) > 0).all()  # in a node: by process, then device id


def test_mesh_refuses_tensor_across_nodes():
    from mtnlg_jax.config import ConfigError
    from mtnlg_jax.parallel.mesh import device_grid

    devices, node_of, _ = simulated_devices(2, 1, 4)
    with pytest.raises(ConfigError, match=r'mesh.tensor.*span nodes \[0, 1\].*2 nodes of 4'):
        device_grid(dict(tensor=8), devices, node_of)


def test_mesh_of_one_process_is_jax_make_mesh():
    import jax

    from mtnlg_jax.parallel.mesh import make_mesh

    mesh = make_mesh(data=2, stage=2, tensor=2)
    reference = jax.make_mesh(mesh.devices.shape, mesh.axis_names, devices=jax.devices())
    assert mesh.device_ids.tolist() == reference.device_ids.tolist()


def test_mesh_is_the_config_mesh_axes_in_order_sized_by_their_keys():
    from mtnlg_jax import config as config_lib
    from mtnlg_jax.config import keys
    from mtnlg_jax.parallel import rules
    from mtnlg_jax.parallel.mesh import mesh_from_config

    axes = ('data', 'stage', 'expert', 'context', 'tensor')  # outermost first (mesh.py)
    assert rules.MESH_AXES == keys.MESH_AXES == axes
    assert [k.name for k in keys.KEYS if k.name.startswith('mesh.')] == [f'mesh.{a}' for a in axes]
    config = config_lib.defaults()
    config.mesh.update(dict(data=-1, stage=2, tensor=2))
    mesh = mesh_from_config(config_lib.resolve(config, 8))
    assert mesh.axis_names == axes
    assert dict(mesh.shape) == dict(data=2, stage=2, expert=1, context=1, tensor=2)


@pytest.mark.parametrize('axis', ['data', 'stage', 'expert', 'context', 'tensor'])
def test_minus_one_fills_any_mesh_axis(axis):
    from mtnlg_jax.config.resolve import resolve_mesh

    mesh = {**dict(data=1, stage=1, expert=1, context=1, tensor=1), axis: -1}
    mesh['stage' if axis == 'data' else 'data'] = 2
    sizes = resolve_mesh(mesh, 8)
    assert sizes[axis] == 4 and list(sizes) == ['data', 'stage', 'expert', 'context', 'tensor']


@pytest.mark.parametrize(
    'sizes, key, message',
    [
        (dict(context=0), 'mesh.context', 'must be a positive integer or -1, got 0'),
        (dict(expert=-2), 'mesh.expert', 'must be a positive integer or -1, got -2'),
        (dict(data=-1, context=-1), 'mesh.context', 'only one mesh axis may be -1'),
        (dict(data=-1, expert=3), 'mesh.data', '-1 cannot fill 8 devices'),
        (dict(data=2, context=3), 'mesh', 'data x context = 2 x 3 = 6, but there are 8'),
        (dict(data=4, expert=2), 'mesh.expert', 'but the model is dense'),
    ],
)
def test_bad_mesh_sizes_are_one_line_config_errors_naming_the_key(sizes, key, message):
    import re

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.config import ConfigError

    config = config_lib.defaults()
    config.mesh.update({'data': 1, **sizes})
    with pytest.raises(ConfigError, match=f'^config key {re.escape(key)}: ') as error:
        config_lib.resolve(config, 8)
    assert message in str(error.value) and '\n' not in str(error.value)
