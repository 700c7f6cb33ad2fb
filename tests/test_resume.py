"""Invariants 3 and 4 of docs/design.md at the command line: a stopped run resumes from its workdir
with the losses the uninterrupted run had, exactly under the same layout, within 1e-4 under
any other (data, stage, tensor, repeats, context), with no conversion step."""

import json
import re
import shutil
import signal
import subprocess
import time

import pytest

from mtnlg_jax.checkpoint.store import TMP_MARKER
from support import ROOT, SMALL_MODEL, TRAIN_ENV, launch_in_process, run_train, train_args

RUN = [
    *SMALL_MODEL,
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.train.eval_batches=1',
    '--config.optimizer.warmup_tokens=2048',
    '--config.optimizer.decay_tokens=20000',  # fixed: the schedule must not depend on steps
]
# 5 steps after the resume point (past the warmup's 4) show the trajectories agree.
STEPS, HALF = 10, 5
DEFAULT_LAYOUT = (4, 1, 2, 1)  # data, stage, tensor, repeats: configs/tiny.py's


def layout_flags(data, stage, tensor, repeats, schedule='1f1b', context=1):
    return [
        f'--config.mesh.data={data}',
        f'--config.mesh.stage={stage}',
        f'--config.mesh.context={context}',
        f'--config.mesh.tensor={tensor}',
        f'--config.pipeline.repeats={repeats}',
        f'--config.pipeline.schedule={schedule}',
    ]


def losses(workdir):
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return {r['step']: r['loss'] for r in records if not r.get('eval')}


def train_ok(workdir, *overrides, data):
    result = run_train(workdir, *RUN, *overrides, data=data)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class Runs:
    """Runs the tests share, made once per module: the uninterrupted run of each model depth
    (under the default layout, a checkpoint at HALF and at STEPS) and the step-HALF workdirs."""

    def __init__(self, tmp_path_factory, data):
        self.tmp, self.data = tmp_path_factory, data
        self._cache = {}

    def uninterrupted(self):
        if 'straight' not in self._cache:
            workdir = self.tmp.mktemp('straight')
            train_ok(
                workdir,
                f'--config.train.steps={STEPS}',
                f'--config.checkpoint.every={HALF}',
                data=self.data,
            )
            self._cache['straight'] = workdir
        return self._cache['straight']

    def stopped_at_half(self, layout, into):
        """A copy in `into` of a run stopped after HALF steps under `layout`."""
        if ('half', layout) not in self._cache:
            if layout == DEFAULT_LAYOUT:  # the uninterrupted run, as it was at HALF
                workdir = self.tmp.mktemp('half')
                shutil.copytree(self.uninterrupted(), workdir, dirs_exist_ok=True)
                shutil.rmtree(workdir / 'checkpoints' / str(STEPS))
            else:
                workdir = self.tmp.mktemp('half')
                train_ok(
                    workdir,
                    *layout_flags(*layout),
                    f'--config.train.steps={HALF}',
                    data=self.data,
                )
            self._cache['half', layout] = workdir
        shutil.copytree(self._cache['half', layout], into)
        return into


@pytest.fixture(scope='module')
def runs(tmp_path_factory, token_data):
    return Runs(tmp_path_factory, token_data)


def start_train(workdir, *overrides, data):
    """launch/train.py started in the background, its output in files (no pipe to fill)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = open(workdir.parent / 'stdout.txt', 'w')
    err = open(workdir.parent / 'stderr.txt', 'w')
    args = train_args(workdir, *RUN, *overrides, data=data)
    return subprocess.Popen(args, stdout=out, stderr=err, cwd=ROOT, env=TRAIN_ENV, text=True)


def wait_until(condition, process, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, 'the run ended before the test could interrupt it'
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.01)


def logged_steps(workdir):
    path = workdir / 'metrics.jsonl'
    return len(path.read_text().splitlines()) if path.exists() else 0


def complete_steps(checkpoints):
    return [int(p.name) for p in checkpoints.glob('*') if p.name.isdigit()]


def incomplete_saves(checkpoints):
    return list(checkpoints.glob(f'*{TMP_MARKER}*'))


def test_a_kill_in_a_save_and_then_a_signal_each_resume_the_run_exactly(
    tmp_path, runs, token_data, capsys, monkeypatch
):
    """A run killed during an async save (checkpoint.every 1) resumes from the newest complete
    checkpoint, naming the incomplete save it ignores. That run (checkpoint.every 0: no save
    of its own before its end) stopped by SIGTERM finishes the step, saves it and exits 0
    (SIGINT takes the same handler, faults.StopSignals). The same command with train.steps 10
    resumes from there, saying what changed, and ends with the uninterrupted losses bit for
    bit; once more (main(argv) in this process: a JAX start-up fewer; the command line's
    nothing to do: test_command_line_contract.py) it has nothing to do and leaves
    config.json as it was. (A run that ended
    at its train.steps and went on with more: the same resume, step for step; its save of the
    last step: the failed-save test's.)"""
    workdir = tmp_path / 'run'
    checkpoints = workdir / 'checkpoints'
    for _ in range(3):  # a kill that lands just after a save completes leaves nothing to test
        process = start_train(
            workdir, '--config.train.steps=1000', '--config.checkpoint.every=1', data=token_data
        )
        wait_until(lambda: complete_steps(checkpoints) and incomplete_saves(checkpoints), process)
        process.kill()
        process.wait()
        if incomplete_saves(checkpoints):
            break
    incomplete = incomplete_saves(checkpoints)
    assert incomplete, 'no kill landed during a save'
    complete = max(complete_steps(checkpoints))
    process = start_train(workdir, '--config.train.steps=1000', data=token_data)
    logged = logged_steps(workdir)
    wait_until(lambda: logged_steps(workdir) >= logged + 2, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, (tmp_path / 'stderr.txt').read_text()[-3000:]
    printed = (tmp_path / 'stdout.txt').read_text()
    assert f'resumed      from step {complete}' in printed
    assert 'ignored incomplete save(s)' in printed and incomplete[0].name in printed
    stopped_at = int(re.search(r'stopped +at step (\d+)', printed).group(1))
    assert complete < stopped_at < STEPS
    assert (checkpoints / str(stopped_at)).is_dir()
    resumed = train_ok(workdir, f'--config.train.steps={STEPS}', data=token_data)
    assert f'resumed      from step {stopped_at}' in resumed.stdout
    assert 'changed: train.steps: 1000 -> 10' in resumed.stdout
    assert losses(workdir) == losses(runs.uninterrupted())  # every step, bit for bit
    config = (workdir / 'config.json').read_text()
    args = train_args(workdir, *RUN, f'--config.train.steps={STEPS}', data=token_data)[2:]
    status, printed, _ = launch_in_process('train', capsys, monkeypatch, *args)
    assert status == 0 and printed.startswith(f'nothing to do: {workdir} is at step {STEPS}')
    assert (workdir / 'config.json').read_text() == config


@pytest.mark.parametrize(
    'saved_under,resumed_under',
    [
        # Out of a pipeline: test_multiprocess.py (1 x 8 pipelined -> 2 x 4 unpipelined); the
        # padded vocabulary changing with tensor: test_checkpoint.py (384 -> 1024 rows). The
        # resumed layouts' 5 steps are also the pipelined trajectories test_pipeline.py held
        # to one device (d2s2t2v1m4 1F1B, d2s2t2v2m4 interleaved).
        ((1, 2, 4, 2, 'gpipe'), (2, 2, 2, 1)),  # GPipe order, v = 2 -> 1F1B, v = 1
        ((4, 1, 2, 1), (2, 2, 2, 2)),  # into a pipeline
        # ZeRO-1 over data 2 x context 2 -> over data 4 (the uninterrupted run's compile) and
        # over context 4: the optimizer state's shards follow the context size
        ((2, 1, 2, 1, '1f1b', 2), (4, 1, 2, 1)),
        ((2, 1, 2, 1, '1f1b', 2), (1, 1, 2, 1, '1f1b', 4)),
    ],
    ids=lambda value: 'x'.join(map(str, value)),
)
def test_a_checkpoint_resumes_under_another_layout_with_the_uninterrupted_losses(
    tmp_path,
    runs,
    token_data,
    saved_under,
    resumed_under,
):
    workdir = runs.stopped_at_half(saved_under, into=tmp_path / 'run')
    resumed = train_ok(
        workdir,
        *layout_flags(*resumed_under),
        f'--config.train.steps={STEPS}',
        data=token_data,
    )
    data, stage, tensor = resumed_under[:3]
    context = resumed_under[5] if len(resumed_under) > 5 else 1
    over = f'context {context} x ' if context > 1 else ''
    assert f'mesh         data {data} x stage {stage} x {over}tensor {tensor}' in resumed.stdout
    zero = f'data {data}' + (f' x context {context}' if context > 1 else '')
    assert f'(ZeRO-1 over {zero})' in resumed.stdout
    assert f'resumed      from step {HALF}' in resumed.stdout
    expected, actual = losses(runs.uninterrupted()), losses(workdir)
    assert sorted(actual) == sorted(expected)
    for step in range(HALF + 1, STEPS + 1):
        assert actual[step] == pytest.approx(expected[step], abs=1e-4), step


def test_a_failed_save_stops_the_run_and_the_previous_checkpoint_resumes_exactly(
    tmp_path,
    runs,
    token_data,
):
    """The save of step 6 fails as on a full disk (the drill, at orbax's commit): one error
    line naming it and the cause, exit 1, step 3 still the newest complete checkpoint. The
    same command with checkpoint.on_save_error=continue resumes from 3, warns when the save of
    6 fails again, saves 9 and the last step, and ends with the uninterrupted losses."""
    workdir = tmp_path / 'run'
    every, failing = 3, 6
    drill = [
        f'--config.train.steps={STEPS}',
        f'--config.checkpoint.every={every}',
        f'--config.checkpoint.inject_save_error_at_step={failing}',
    ]
    stopped = run_train(workdir, *RUN, *drill, data=token_data)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    errors = [line for line in stopped.stderr.splitlines() if 'error' in line.lower()]
    assert len(errors) == 1 and stopped.stderr.strip().splitlines()[-1] == errors[0], errors
    assert errors[0].startswith(
        f'error: checkpoint {workdir}/checkpoints/{failing} was not saved: '
    )
    assert 'No space left on device' in errors[0]
    assert f'the newest complete checkpoint is step {every}' in errors[0]
    assert complete_steps(workdir / 'checkpoints') == [every]
    assert max(losses(workdir)) < failing + every  # it stopped before its next save
    going_on = train_ok(
        workdir, *drill, '--config.checkpoint.on_save_error=continue', data=token_data
    )
    assert f'resumed      from step {every}' in going_on.stdout
    assert 'ignored incomplete save(s)' in going_on.stdout
    assert f'warning: checkpoint {workdir}/checkpoints/{failing} was not saved' in going_on.stderr
    assert sorted(complete_steps(workdir / 'checkpoints')) == [every, failing + every, STEPS]
    assert losses(workdir) == losses(runs.uninterrupted())


LLAMA = [  # support.LLAMA_BLOCK at the command line, pipelined as the Llama 3 configs run
    '--config.model.position=rope',
    '--config.model.rope_theta=500000.0',
    '--config.model.rope_scaling.type=llama3',
    '--config.model.rope_scaling.original_context=16',
    '--config.model.norm=rmsnorm',
    '--config.model.mlp=swiglu',
    '--config.model.kv_heads=4',
    '--config.model.tie_embeddings=False',
    '--config.model.bias=False',
    '--config.model.sequence_parallel=True',
    '--config.model.sequence_pieces=2',
    '--config.model.remat=selective',
    *layout_flags(2, 2, 2, 2, 'interleaved'),
]


def test_a_pipelined_llama_stopped_halfway_resumes_with_identical_losses(tmp_path, token_data):
    """The Llama block (rope with llama3 scaling, GQA, SwiGLU, untied), interleaved over 2
    stages, sequence parallel in two pieces, selective recompute: the run resumed from its
    step-HALF checkpoint logs the losses of the run that went straight on, bit for bit."""
    straight = tmp_path / 'straight'
    train_ok(
        straight,
        *LLAMA,
        f'--config.train.steps={STEPS}',
        f'--config.checkpoint.every={HALF}',
        data=token_data,
    )
    workdir = tmp_path / 'resumed'
    shutil.copytree(straight, workdir)
    shutil.rmtree(workdir / 'checkpoints' / str(STEPS))
    records = (workdir / 'metrics.jsonl').read_text().splitlines()
    kept = [line for line in records if json.loads(line)['step'] <= HALF]
    (workdir / 'metrics.jsonl').write_text(''.join(line + '\n' for line in kept))
    resumed = train_ok(workdir, *LLAMA, f'--config.train.steps={STEPS}', data=token_data)
    assert f'resumed      from step {HALF}' in resumed.stdout
    expected, actual = losses(straight), losses(workdir)
    assert sorted(actual) == list(range(1, STEPS + 1))
    assert actual == expected
