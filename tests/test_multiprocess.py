"""Several processes through jax.distributed (gloo on CPU, localhost), at the command line:
launch/spawn.py runs launch/train.py as 2 processes x 4 devices.

- faults in one workdir, each run the same command (2 x 4 devices, mesh data 4 x tensor 2,
  data spanning the processes: the same global batches as 1 x 8): a process lost
  mid-run ends the other through the heartbeat; SIGTERM to every process saves one step and
  exits 0; a paused process (SIGSTOP) ends the job; the last run resumes to the losses of the
  uninterrupted 1 x 8 run;
- a process that hangs (the drill, a fresh run of its own) ends itself through its watchdog,
  naming itself, and the job with it;
- checkpoints written by 2 processes restore under 1, and the reverse, into a pipeline
  (data 2 x stage 2 x tensor 2: its stages' hand-offs within a process, data across them);
- bad input (coordinator, process count) is one `error:` line, exit 2, nothing written.

Every process is bounded by `timeout -k` (JAX's preemption notifier takes SIGTERM).
"""

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from support import ROOT, SMALL_MODEL, TRAIN_ENV, launch_in_process, launch_module, train_args

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


def as_of(source, into, step):
    """A copy of a run's workdir as it was after `step` (its later checkpoints removed)."""
    shutil.copytree(source, into)
    for checkpoint in (into / 'checkpoints').iterdir():
        if not checkpoint.name.isdigit() or int(checkpoint.name) > step:
            shutil.rmtree(checkpoint)
    assert (into / 'checkpoints' / str(step)).is_dir()
    return into


@pytest.fixture(scope='module')
def one_by_eight(tmp_path_factory, token_data):
    """The uninterrupted run: 1 process x 8 devices, checkpoints at steps 5 and 10."""
    workdir = tmp_path_factory.mktemp('one_by_eight')
    ok(one_process(workdir, *NO_PIPELINE, data=token_data))
    return workdir


def test_checkpoints_restore_across_process_counts_and_layouts(
    tmp_path, token_data, one_by_eight, faults
):
    expected = losses(one_by_eight)
    from_one = as_of(one_by_eight, tmp_path / 'from_one', 5)
    resumed = ok(two_processes(from_one, *PIPELINED, data=token_data))
    assert 'resumed      from step 5' in resumed.stdout
    np.testing.assert_allclose(losses(from_one), expected, atol=1e-4, rtol=0)
    # The checkpoint the lost-process run wrote (2 processes) before process 1 was lost.
    from_two = as_of(faults[1]['after_loss'], tmp_path / 'from_two', SAVED_BEFORE_KILL)
    resumed = ok(one_process(from_two, *PIPELINED, data=token_data))
    assert f'resumed      from step {SAVED_BEFORE_KILL}' in resumed.stdout
    np.testing.assert_allclose(losses(from_two), expected, atol=1e-4, rtol=0)


def assert_rejected(result, *words):
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_bad_coordinator_or_process_count_is_one_error_line(
    tmp_path, token_data, capsys, monkeypatch
):
    """Each bad flag of one process's command line in this process (refused before JAX's
    distributed start-up: a subprocess each cost a JAX start-up; the command line itself:
    test_command_line_contract.py); then spawn's 3 processes at the command line."""
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
        args = train_args(workdir, *MODEL, *flags, data=token_data)[2:]  # without the script
        status, _, lines = launch_in_process('train', capsys, monkeypatch, *args)
        assert time.monotonic() - started < 30
        assert status == 2 and len(lines) == 1 and lines[0].startswith('error: '), lines
        for word in words:
            assert word in lines[0], lines[0]
    # 3 processes x 2 devices for a mesh of 8: every process says so, spawn adds nothing.
    command = train_args(workdir, *MODEL, *PIPELINED, data=token_data)[1:]
    spawn = [sys.executable, str(ROOT / 'launch/spawn.py'), '--processes', '3']
    started = time.monotonic()
    result = run([*spawn, '--devices_per_process', '2', '--', *command], limit=60)
    assert time.monotonic() - started < 30
    assert_rejected(result, 'config key mesh', 'there are 6 devices')
    assert not workdir.exists()


def test_spawn_names_the_killed_process_when_its_peer_ends_in_the_same_poll():
    spawn = launch_module('spawn')
    Ended = collections.namedtuple('Ended', 'returncode')
    # Process 0 saw its peer's closed connection and exited 1 within the same 0.1 s poll.
    processes = [Ended(1), Ended(-9), Ended(None)]
    assert spawn.first_failure(processes, [0, 1]) == 1
    assert spawn.first_failure(processes, [0]) == 0
    # Process 1's watchdog ended it (status 3); process 0's collective failed in the same poll.
    assert spawn.first_failure([Ended(1), Ended(3)], [0, 1]) == 1
    assert spawn.first_failure([Ended(0), Ended(0)], [0, 1]) is None


# Faults, each run the same command on one workdir: no run ends on its own (train.steps 1000;
# the schedule does not depend on it) until the last, which sets 10 to compare with 1 x 8.
HANG_S = 10  # the hang run's train.hang_timeout_s; the heartbeat timeout (MODEL) is 10 s too
KILL_AT, SAVED_BEFORE_KILL = 4, 3  # process 1 lost after step 4; the checkpoint of step 3
FAULTS = [
    *NO_PIPELINE,  # the pipelined layout's compile in only the two runs that restore into it
    '--config.train.steps=1000',
    '--config.checkpoint.every=3',
    f'--config.train.inject_kill_at_step={KILL_AT}',  # in a run started from scratch only
    '--config.train.inject_kill_process=1',
]
# The hang drill, in a fresh run of its own (the drills act in runs started from scratch),
# made before any other of this program: process 1 never reads the compilation cache (JAX
# writes it from process 0 only), so a process 0 that did would wait in its first step for
# process 1's compile, a wait a fixed hang_timeout_s would count as a stall.
HANG = [
    *FAULTS[:-2],
    f'--config.train.hang_timeout_s={HANG_S}',
    '--config.train.inject_hang_at_step=5',
    '--config.train.inject_hang_process=1',
]


class Background:
    """launch/spawn.py (2 x 4 devices) running `overrides` in the background, its output in
    files; `pid_of(1)` finds process 1 by a mark in its environment."""

    def __init__(self, workdir, *overrides, data, grace_s=10):
        self.workdir, self.mark = workdir, f'{workdir.name}-{time.monotonic_ns()}'
        command = train_args(workdir, *MODEL, *overrides, data=data)[1:]
        spawn = [sys.executable, str(ROOT / 'launch/spawn.py'), '--processes', '2']
        spawn += ['--devices_per_process', '4', '--grace_s', str(grace_s), '--', *command]
        self.stdout = workdir.parent / f'{self.mark}.out'
        self.stderr = workdir.parent / f'{self.mark}.err'
        self.process = subprocess.Popen(
            bounded(spawn, limit=180),
            stdout=open(self.stdout, 'w'),
            stderr=open(self.stderr, 'w'),
            cwd=ROOT,
            env=dict(TRAIN_ENV, MTNLG_JAX_TEST_RUN=self.mark),
        )

    def wait_until(self, condition, timeout=150):
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, self.stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, 'timed out'
            time.sleep(0.05)
        return time.monotonic()

    def logged_step(self):
        path = self.workdir / 'metrics.jsonl'
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-1])['step'] if lines else 0

    def pid_of(self, index):
        wanted = (f'MTNLG_JAX_TEST_RUN={self.mark}'.encode(), f'JAX_PROCESS_ID={index}'.encode())
        for pid in filter(str.isdigit, os.listdir('/proc')):
            try:
                environ = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
            except OSError:
                continue
            if all(w in environ for w in wanted):
                return int(pid)
        raise AssertionError(f'no process {index} of {self.mark}')

    def finish(self):
        """(exit status, seconds from now until it ended, stdout, stderr)."""
        started = time.monotonic()
        status = self.process.wait()
        return status, time.monotonic() - started, self.stdout.read_text(), self.stderr.read_text()


@pytest.fixture(scope='module')
def hang(tmp_path_factory, token_data):
    """A fresh run whose process 1 hangs at step 5: (its result, process 1's log)."""
    workdir = tmp_path_factory.mktemp('hang') / 'run'
    workdir.parent.mkdir(exist_ok=True)
    hung = Background(workdir, *HANG, data=token_data)
    log = workdir / 'logs' / 'process_1.log'
    hung.wait_until(lambda: log.exists() and 'hangs at step 5' in log.read_text())
    return hung.finish(), log.read_text()


@pytest.fixture(scope='module')
def faults(tmp_path_factory, token_data, hang):  # after the hang run: see HANG
    """The workdir through: process 1 lost after step 4 (checkpoint at 3, spawn's grace 60 s:
    the survivor must end itself); the same command again (it resumes from 3), SIGTERM to
    every process once a step past 4 is logged; again, SIGSTOP to process 1 once a step is
    logged; again with train.steps 10, to the end."""
    workdir = tmp_path_factory.mktemp('faults') / 'run'
    workdir.parent.mkdir(exist_ok=True)
    results = {}
    killed = Background(workdir, *FAULTS, data=token_data, grace_s=60)
    results['killed'] = killed.finish()
    log = workdir / 'logs' / 'process_1.log'
    results['killed_log'] = log.exists()  # each run writes process 1's log anew
    results['after_loss'] = workdir.parent / 'after_loss'  # later runs' saves replace its 3
    shutil.copytree(workdir, results['after_loss'])
    preempted = Background(workdir, *FAULTS, data=token_data)
    preempted.wait_until(lambda: preempted.logged_step() > KILL_AT)
    preempted.process.send_signal(signal.SIGTERM)  # timeout passes it on to spawn, spawn to all
    results['preempted'] = preempted.finish()
    results['preempted_log'] = log.read_text()
    paused = Background(workdir, *FAULTS, data=token_data, grace_s=2)
    resumed_at = preempted.logged_step()
    paused.wait_until(lambda: paused.logged_step() > resumed_at)
    os.kill(paused.pid_of(1), signal.SIGSTOP)
    results['paused'] = paused.finish()
    last = Background(workdir, *FAULTS, '--config.train.steps=10', data=token_data)
    results['last'] = last.finish()
    return workdir, results


def test_two_processes_end_when_one_is_lost_and_the_same_command_resumes(faults):
    _, results = faults
    # The lost process ends the survivor by itself (heartbeat 10 s; spawn's grace is 60 s),
    # non-zero, and spawn says so in one line naming the lost process.
    status, _, _, stderr = results['killed']
    assert status == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    lost = re.match(r'error: process 1 of 2 was killed by SIGKILL after (\d+) s', last)
    survivor = re.search(r'; process 0 (.*) after (\d+) s([^;]*)$', last)
    assert lost and survivor and 'stopped by spawn' not in survivor.group(3), last
    assert survivor.group(1) != 'exited with status 0', last
    assert int(survivor.group(2)) - int(lost.group(1)) < 60, last
    assert results['killed_log']
    # The same command resumes from the checkpoint before the loss (the last run of the
    # workdir ends with the uninterrupted losses: the test after the next three).
    assert f'resumed      from step {SAVED_BEFORE_KILL}' in results['preempted'][2]


def test_a_hung_process_ends_itself_with_its_stacks_and_the_job_with_it(hang):
    (status, seconds, _, stderr), log = hang
    assert status == 1, stderr[-3000:]
    assert seconds < HANG_S + 30, seconds  # every process, counted from process 1's hang
    # spawn names process 1 and its line; process 1's own log holds every thread's stack.
    last = stderr.strip().splitlines()[-1]
    assert re.match(r'error: process 1 of 2 exited with status 3 after \d+ s', last), last
    stalled = (
        f'error: process 1 of 2 stalled: batch (step 5) made no progress for {HANG_S} s '
        f'(allowance {HANG_S} s: train.hang_timeout_s), its main thread at '
        'mtnlg_jax/train/faults.py'
    )
    assert f'(its last line: {stalled}' in last, last
    assert 'process 1 of 2: stacks of every thread' in log
    assert re.search(r'File ".*mtnlg_jax/train/faults.py", line \d+ in hang_if_drilled', log)
    assert re.search(r'File ".*mtnlg_jax/data/loader.py", line \d+ in _produce', log)  # a thread


def test_sigterm_to_every_process_saves_one_step_and_exits_0(faults):
    workdir, results = faults
    status, _, stdout, stderr = results['preempted']
    assert status == 0, stderr[-3000:]
    assert f'resumed      from step {SAVED_BEFORE_KILL}' in stdout
    stopped = re.findall(r'stopped +at step (\d+) on request', stdout + results['preempted_log'])
    assert len(stopped) == 2 and stopped[0] == stopped[1], stopped  # process 0's and 1's
    assert (workdir / 'checkpoints' / stopped[0]).is_dir()


def test_a_paused_process_ends_the_job_within_the_timeout(faults):
    status, seconds, _, stderr = faults[1]['paused']
    assert status == 1, stderr[-3000:]
    assert seconds < HANG_S + 30, seconds


def test_after_a_lost_process_a_preemption_and_a_pause_the_same_command_resumes_exactly(
    one_by_eight, faults
):
    workdir, results = faults
    status, _, stdout, stderr = results['last']
    assert status == 0, stderr[-3000:]
    stopped = re.search(r'stopped +at step (\d+)', results['preempted'][2]).group(1)
    assert f'resumed      from step {stopped}' in stdout
    np.testing.assert_allclose(losses(workdir), losses(one_by_eight), rtol=1e-6, atol=0)


def spawn_module():
    return launch_module('spawn')


def test_spawn_takes_the_command_with_or_without_the_double_dash():
    spawn = spawn_module()
    command = ['launch/train.py', '--config', 'configs/tiny.py', '--processes', '3']
    flags = ['--processes', '2', '--devices_per_process', '4']
    with_dash = spawn.parse_args([*flags, '--', *command])
    without = spawn.parse_args([*flags, *command])
    assert with_dash.command == without.command == command and without.processes == 2


def test_spawn_passes_process_zeros_output_on_without_gloos_notices():
    """Chunks as they arrive: a notice split across reads, a progress bar's carriage returns
    passed on at once (not held for a newline)."""
    import io

    out = io.BytesIO()
    quiet = spawn_module().QuietGloo(out)
    chunks = [
        b'config ok\n[Gl',
        b'oo] Rank 0 is connected to 1 peer ranks. Expected',
        b' 1\n',
        b'\r 50%|#####',
        b'\r100%|##########|\n[Gloo] Rank 0 is connected\n',
        b'done [',
    ]
    seen = []
    for chunk in chunks:
        quiet.feed(chunk)
        seen.append(out.getvalue())
    quiet.close()
    assert seen[3].endswith(b'\r 50%|#####')  # drawn in place at once
    assert out.getvalue() == b'config ok\n\r 50%|#####\r100%|##########|\ndone ['


def test_process_zeros_error_line_stays_last_after_spawns_warnings():
    """An `error:` line is held until more output or `close`: a warning spawn prints once the
    processes have ended (a log the full disk refused) comes before it, not after."""
    import io

    out = io.BytesIO()
    quiet = spawn_module().QuietGloo(out)
    quiet.feed(b'step 4\nerror: not saved\n')
    assert out.getvalue() == b'step 4\n'
    out.write(b'warning: log not written in full\n')
    quiet.close()
    assert out.getvalue().splitlines()[-1] == b'error: not saved'
    quiet = spawn_module().QuietGloo(out := io.BytesIO())
    quiet.feed(b'error: retrying\n')
    quiet.feed(b'step 5\n')  # not the last line: passed on with what follows it
    assert out.getvalue() == b'error: retrying\nstep 5\n'
    # An unbuffered print writes the line and its newline apart; a read can end anywhere.
    quiet = spawn_module().QuietGloo(out := io.BytesIO())
    for piece in (b'step 6\r 5%\rerr', b'or: not saved', b'\n'):
        quiet.feed(piece)
    assert out.getvalue() == b'step 6\r 5%\r'
    out.write(b'warning: log not written in full\n')
    quiet.close()
    assert out.getvalue().splitlines()[-1] == b'error: not saved'
