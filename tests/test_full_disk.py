"""A full disk ends a run in one line: a real full file system (a tmpfs sized to hold one
checkpoint of the small model and not two), on one process and on two under launch/spawn.py;
metrics and tensorboard on a full disk; a read-only file system at a save. The tests that
need a mount skip, saying why, where this process cannot mount one (not root, no tmpfs)."""

import errno
import json
import os
import subprocess
import sys

import pytest

from mtnlg_jax.run import storage
from support import ROOT, SMALL_MODEL, TRAIN_ENV, launch_in_process, run_train, train_args

RUN = [
    *SMALL_MODEL,
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.train.eval_batches=1',
    '--config.train.steps=6',
    '--config.checkpoint.every=2',  # 2 fits, 4 does not
]
ONE_CHECKPOINT = '4m'  # the small model's checkpoint is 2.7 MB (measured with du)


class Mount:
    """A tmpfs at `path` of `size`, unmounted at the end; resize() grows or shrinks it in
    place, read_only() remounts it so."""

    def __init__(self, path, size):
        self.path = path
        os.makedirs(path, exist_ok=True)
        made = subprocess.run(
            ['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f'cannot mount a tmpfs to fill (needs root): {made.stderr.strip()}')

    def remount(self, options):
        subprocess.run(['mount', '-o', f'remount,{options}', str(self.path)], check=True)

    def close(self):
        subprocess.run(['umount', '-l', str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    mounts = []

    def make(size):
        mounts.append(Mount(tmp_path / f'disk{len(mounts)}', size))
        return mounts[-1]

    yield make
    for mount in mounts:
        mount.close()


def losses(workdir):
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return {r['step']: r['loss'] for r in records if not r.get('eval')}


def assert_one_error_line(output, *expected):
    """No traceback from any thread, one `error:` line and it is the last."""
    assert 'Traceback' not in output and 'Event loop is closed' not in output, output[-3000:]
    lines = output.strip().splitlines()
    errors = [line for line in lines if line.startswith('error') or 'ERROR' in line]
    assert len(errors) == 1 and lines[-1] == errors[0], errors
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def test_a_full_disk_at_a_save_is_one_line_and_the_kept_checkpoint_resumes_exactly(
    small_disk, token_data
):
    """The save of step 4 meets a full tmpfs: status 1, one error line naming the cause and
    step 2, no traceback; with the disk grown, the same command resumes from 2 and logs the
    losses the stopped run logged, bit for bit."""
    disk = small_disk(ONE_CHECKPOINT)
    workdir = disk.path / 'run'
    stopped = run_train(workdir, *RUN, data=token_data)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert_one_error_line(
        stopped.stderr,
        f'error: checkpoint {workdir}/checkpoints/4 was not saved: No space left on device '
        '(ENOSPC)',
        'the newest complete checkpoint is step 2',
    )
    before = losses(workdir)
    assert sorted((workdir / 'checkpoints').glob('[0-9]')) == [workdir / 'checkpoints/2']
    disk.remount('size=16m')  # the user frees space
    resumed = run_train(workdir, *RUN, data=token_data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'resumed      from step 2' in resumed.stdout
    after = losses(workdir)
    assert max(before) > 3 and all(after[s] == before[s] for s in before), (before, after)


def spawn_two(workdir, *extra, data):
    """`launch/spawn.py`, 2 processes x 4 devices, training RUN in `workdir`."""
    spawn = [sys.executable, str(ROOT / 'launch/spawn.py'), '--processes', '2']
    spawn += ['--devices_per_process', '4', '--grace_s', '30', '--']
    command = train_args(workdir, *RUN, *extra, data=data)[1:]  # without sys.executable
    return subprocess.run(
        ['timeout', '-k', '5', '240', *spawn, *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=TRAIN_ENV,
    )


# Alone, after the rest: beside two other test files on 2 cores the full disk refuses the
# writes of one process or of both, at step 4 or later, from run to run.
@pytest.mark.serial
def test_a_full_disk_under_two_processes_is_one_line(small_disk, token_data):
    """launch/spawn.py, 2 processes x 4 devices on one full tmpfs: status 1, the one error
    line on the terminal, none from spawn, no traceback in either process's output."""
    disk = small_disk(ONE_CHECKPOINT)
    workdir = disk.path / 'run'
    result = spawn_two(workdir, data=token_data)
    assert result.returncode == 1, result.stderr[-3000:]
    line = assert_one_error_line(
        result.stderr, 'No space left on device (ENOSPC)', 'the newest complete checkpoint is'
    )
    log_path = workdir / 'logs/process_1.log'
    log = log_path.read_text() if log_path.exists() else ''
    assert 'Traceback' not in log, log[-3000:]
    # Process 1 ends on the same line: in spawn's warning where the full disk refused the log,
    # else in the log, whose last line the disk may have cut (how much room the failed save
    # left decides which).
    refused = [row for row in result.stderr.splitlines() if 'process_1.log: not written' in row]
    if refused:  # spawn's warning quotes the line's first 300 characters
        assert refused[0].split('ended on: ', 1)[1] == line[:300], result.stderr[-3000:]
    else:
        ended_on = log.strip().splitlines()[-1]
        assert ended_on.startswith('error: checkpoint ') and line.startswith(ended_on), log[-3000:]


def test_a_save_that_fails_on_one_process_fails_on_both_and_the_run_goes_on(tmp_path, token_data):
    """The save drill on process 1 only (its write of step 4 refused, process 0's written):
    both processes warn in the same line within the step (orbax alone would leave them
    waiting at different barriers for 20 minutes), step 4 is never committed, and the run
    saves step 6 and ends (checkpoint.on_save_error=continue)."""
    workdir = tmp_path / 'run'
    drill = ['--config.checkpoint.inject_save_error_at_step=4']
    drill += ['--config.checkpoint.inject_save_error_process=1']
    result = spawn_two(
        workdir, *drill, '--config.checkpoint.on_save_error=continue', data=token_data
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cause = 'No space left on device (ENOSPC) (a drill) on process 1'
    warning = f'warning: checkpoint {workdir}/checkpoints/4 was not saved: {cause}'
    warned = [row for row in result.stderr.splitlines() if row.startswith(warning)]
    log = (workdir / 'logs/process_1.log').read_text()
    assert len(warned) == 1 and warned[0] in log.splitlines(), (warned, log[-3000:])
    assert 'Traceback' not in result.stderr + log, result.stderr[-3000:]
    steps = sorted(p.name for p in (workdir / 'checkpoints').iterdir())
    assert [s for s in steps if s.isdigit()] == ['2', '6'], steps


def test_metrics_on_a_full_disk_warn_once_and_never_block(small_disk, capsys):
    """metrics.jsonl and tensorboard on a disk that fills: one warning, `failed` names it,
    and writing on (tensorboard's writer thread dead) returns at once."""
    from mtnlg_jax.train import metrics as metrics_lib

    disk = small_disk('64k')
    (disk.path / 'run').mkdir()
    writer = metrics_lib.MetricsWriter(str(disk.path / 'run'))
    record = dict(step=0, loss=1.0, note='x' * 1000)
    for step in range(200):  # 200 kB: the disk fills on the way
        writer.write(dict(record, step=step))
    writer.close()
    assert writer.failed and 'No space left on device (ENOSPC)' in writer.failed
    err = capsys.readouterr().err
    assert err.count('warning: ') == 1 and 'Traceback' not in err, err


def test_a_read_only_file_system_at_a_save_is_one_save_error(small_disk, capfd):
    """A file system remounted read-only between two saves: the second is a SaveError naming
    EROFS and the kept step, nothing printed from orbax's threads."""
    import jax.numpy as jnp

    from mtnlg_jax.checkpoint import store

    disk = small_disk('8m')
    checkpoints = store.Checkpoints(str(disk.path / 'run'))
    state = dict(w=jnp.arange(1024.0))
    checkpoints.save(1, state, dict(step=1))
    checkpoints.wait()
    disk.remount('ro')
    with pytest.raises(store.SaveError) as error:
        checkpoints.save(2, state, dict(step=2))
        checkpoints.wait()
    assert 'Read-only file system (EROFS)' in str(error.value), error.value
    assert 'the newest complete checkpoint is step 1' in str(error.value)
    captured = capfd.readouterr()
    assert 'Traceback' not in captured.err + captured.out, captured.err[-3000:]


def test_storage_refusals_are_read_from_orbax_text_and_error_chains():
    """tensorstore's text of a failed write carries the errno; an OSError's chain too."""
    text = "RESOURCE_EXHAUSTED: ... Failed to write 252383 bytes: [os_error_code='28']"
    assert storage.refusal(ValueError(text)) == 'No space left on device (ENOSPC)'
    try:
        try:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        except OSError as quota:
            raise RuntimeError('commit failed') from quota
    except RuntimeError as chained:
        assert storage.refusal(chained) == f'{os.strerror(errno.EDQUOT)} (EDQUOT)'
    assert storage.refusal(ValueError('a shape mismatch')) is None


def _documents(path, count=3000):
    with open(path, 'w') as f:
        for i in range(count):
            words = ' '.join(f'word{(i * 7 + j) % 1000} thing{j}' for j in range(40))
            f.write(json.dumps({'text': words}) + '\n')
    return path


@pytest.fixture(scope='module')
def embedded():
    """One embedded Ray for the two tools' drills (each tool's own start costs 10 to 30 s)."""
    from mtnlg_jax.data import ray_engine

    with ray_engine.started(2, object_store_mb=80) as ray:
        yield ray


@pytest.mark.parametrize('tool', ['preprocess', 'curate'])
def test_a_full_disk_under_curation_or_preprocessing_output_is_one_line(
    embedded, small_disk, tmp_path, capfd, monkeypatch, tool
):
    """Ray's workers meet a full 256 kB tmpfs: status 1, one error line naming the output and
    the cause, none of Ray Data's logs of the failed task. Each tool's main(argv) in this
    process on the module's embedded Ray (the command lines: test_command_line_contract.py);
    capfd reads the process's own file descriptors, where Ray's log handlers write."""
    disk = small_disk('256k')
    documents = _documents(tmp_path / 'docs.jsonl')
    if tool == 'preprocess':
        output = disk.path / 'corpus'
        args = ['--input', documents, '--train-tokenizer', '--vocab-size', '280']
        args += ['--tokenizer-model', tmp_path / 'tok.model', '--output-prefix', output]
        expected = f'error: {output}: not written: No space left on device (ENOSPC)'
    else:
        output = disk.path / 'curated.jsonl'
        args = ['--input', documents, '--output', output]
        expected = f'error: --output {output}: not written: No space left on device (ENOSPC)'
    status, printed, errors = launch_in_process(tool, capfd, monkeypatch, *args)
    assert status == 1, errors[-30:]
    assert_one_error_line('\n'.join(errors), expected)
    assert 'ERROR' not in printed and 'Traceback' not in printed
