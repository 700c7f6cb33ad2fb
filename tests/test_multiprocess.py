"""Several processes through jax.distributed (gloo on CPU, localhost), at the command line:
launch/spawn.py runs launch/train.py as 2 processes x 4 devices.

- 2 x 4 devices give the losses of 1 x 8 (mesh data 2 x stage 2 x tensor 2, data spanning
  the processes: the same global batches), a process lost mid-run ends the other through the
  heartbeat, and the same command resumes to the uninterrupted losses;
- checkpoints written by 2 processes restore under 1, and the reverse, in another layout;
- bad input (coordinator, process count) is one `error:` line, exit 2, nothing written.

Every process is bounded by `timeout -k` (JAX's preemption notifier takes SIGTERM).
"""

import collections
import json
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from support import ROOT, SMALL_MODEL, TRAIN_ENV, train_args

# SMALL_MODEL with 2 layers, a checkpoint at step 5 of 10, a 10 s heartbeat (later flags win).
MODEL = [
    *SMALL_MODEL,
    '--config.model.num_layers=2',
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.train.eval_batches=1',
    '--config.optimizer.warmup_tokens=2048',
    '--config.optimizer.decay_tokens=20000',
    '--config.train.steps=10',
    '--config.checkpoint.every=5',
    '--config.distributed.heartbeat_timeout_s=10',
]
PIPELINED = ['--config.mesh.data=2', '--config.mesh.stage=2', '--config.mesh.tensor=2']
NO_PIPELINE = ['--config.mesh.data=4', '--config.mesh.stage=1', '--config.mesh.tensor=2']
LIMIT_S = 300


def bounded(args, limit=LIMIT_S):
    return ['timeout', '-k', '10', str(limit), *args]


def run(args, limit=LIMIT_S):
    return subprocess.run(
        bounded(args, limit), capture_output=True, text=True, cwd=ROOT, env=TRAIN_ENV
    )


def one_process(workdir, *overrides, data):
    return run(train_args(workdir, *MODEL, *overrides, data=data))


def two_processes(workdir, *overrides, data, grace_s=10):
    command = train_args(workdir, *MODEL, *overrides, data=data)[1:]  # without the python
    spawn = [sys.executable, str(ROOT / 'launch/spawn.py'), '--processes', '2']
    return run([*spawn, '--devices_per_process', '4', '--grace_s', str(grace_s), '--', *command])


def ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(workdir):
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return np.array([r['loss'] for r in records if not r.get('eval')])


def without_last_checkpoint(source, into):
    """A copy of a finished 10-step run as it was after step 5."""
    shutil.copytree(source, into)
    shutil.rmtree(into / 'checkpoints' / '10')
    return into


@pytest.fixture(scope='module')
def one_by_eight(tmp_path_factory, token_data):
    """The uninterrupted run: 1 process x 8 devices, checkpoints at steps 5 and 10."""
    workdir = tmp_path_factory.mktemp('one_by_eight')
    ok(one_process(workdir, *PIPELINED, data=token_data))
    return workdir


@pytest.fixture(scope='module')
def two_by_four(tmp_path_factory, token_data, one_by_eight):
    """The same run as 2 processes x 4 devices, process 1 lost at step 7, then the same
    command again; returns (workdir, the killed run, the resumed run)."""
    workdir = tmp_path_factory.mktemp('two_by_four')
    drill = ['--config.train.inject_kill_at_step=7', '--config.train.inject_kill_process=1']
    killed = two_processes(workdir, *PIPELINED, *drill, data=token_data, grace_s=60)
    resumed = two_processes(workdir, *PIPELINED, *drill, data=token_data)
    return workdir, killed, resumed


def test_two_processes_give_one_process_losses_and_survive_a_lost_process(
    one_by_eight, two_by_four
):
    workdir, killed, resumed = two_by_four
    # The lost process ends the survivor by itself (heartbeat 10 s; spawn's grace is 60 s),
    # non-zero, and spawn says so in one line naming the lost process.
    assert killed.returncode == 1, killed.stderr[-3000:]
    last = killed.stderr.strip().splitlines()[-1]
    lost = re.match(r'error: process 1 of 2 was killed by SIGKILL after (\d+) s', last)
    survivor = re.search(r'; process 0 (.*) after (\d+) s([^;]*)$', last)
    assert lost and survivor and 'stopped by spawn' not in survivor.group(3), last
    assert survivor.group(1) != 'exited with status 0', last
    assert int(survivor.group(2)) - int(lost.group(1)) < 60, last
    assert (workdir / 'logs' / 'process_1.log').exists()
    # The same command resumes from the checkpoint of step 5 and ends where 1 x 8 ended.
    ok(resumed)
    assert 'resumed      from step 5' in resumed.stdout
    np.testing.assert_allclose(losses(workdir), losses(one_by_eight), rtol=1e-6, atol=0)


def test_checkpoints_restore_across_process_counts_and_layouts(
    tmp_path, token_data, one_by_eight, two_by_four
):
    expected = losses(one_by_eight)
    from_one = without_last_checkpoint(one_by_eight, tmp_path / 'from_one')
    ok(two_processes(from_one, *NO_PIPELINE, data=token_data))
    np.testing.assert_allclose(losses(from_one), expected, atol=1e-4, rtol=0)
    from_two = without_last_checkpoint(two_by_four[0], tmp_path / 'from_two')
    ok(one_process(from_two, *NO_PIPELINE, data=token_data))
    np.testing.assert_allclose(losses(from_two), expected, atol=1e-4, rtol=0)


def assert_rejected(result, *words):
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_bad_coordinator_or_process_count_is_one_error_line(tmp_path, token_data):
    workdir = tmp_path / 'run'
    for flags, words in (
        (['--coordinator=localhost', '--num_processes=2', '--process_id=1'], ['HOST:PORT']),
        (
            ['--coordinator=no-such-host.invalid:1234', '--num_processes=2', '--process_id=1'],
            ['no-such-host.invalid'],
        ),
        (
            ['--coordinator=localhost:1234', '--num_processes=2', '--process_id=2'],
            ['--process_id', '0 .. 1'],
        ),
        (['--num_processes=2'], ['--coordinator']),
    ):
        started = time.monotonic()
        result = run(train_args(workdir, *MODEL, *flags, data=token_data), limit=60)
        assert time.monotonic() - started < 30
        assert_rejected(result, *words)
    # 3 processes x 2 devices for a mesh of 8: every process says so, spawn adds nothing.
    command = train_args(workdir, *MODEL, *PIPELINED, data=token_data)[1:]
    spawn = [sys.executable, str(ROOT / 'launch/spawn.py'), '--processes', '3']
    started = time.monotonic()
    result = run([*spawn, '--devices_per_process', '2', '--', *command], limit=60)
    assert time.monotonic() - started < 30
    assert_rejected(result, 'config key mesh', 'there are 6 devices')
    assert not workdir.exists()


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
    grid = device_grid(data, stage, tensor, devices, node_of)
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
        device_grid(1, 1, 8, devices, node_of)


def test_mesh_of_one_process_is_jax_make_mesh():
    import jax

    from mtnlg_jax.parallel.mesh import make_mesh

    mesh = make_mesh(2, 2, 2)
    reference = jax.make_mesh((2, 2, 2), ('data', 'stage', 'tensor'), devices=jax.devices())
    assert mesh.device_ids.tolist() == reference.device_ids.tolist()


def test_spawn_names_the_killed_process_when_its_peer_ends_in_the_same_poll():
    import importlib.util

    spec = importlib.util.spec_from_file_location('spawn', ROOT / 'launch/spawn.py')
    spawn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(spawn)
    Ended = collections.namedtuple('Ended', 'returncode')
    # Process 0 saw its peer's closed connection and exited 1 within the same 0.1 s poll.
    processes = [Ended(1), Ended(-9), Ended(None)]
    assert spawn.first_failure(processes, [0, 1]) == 1
    assert spawn.first_failure(processes, [0]) == 0
    assert spawn.first_failure([Ended(0), Ended(0)], [0, 1]) is None
