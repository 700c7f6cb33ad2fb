"""Faults at the command line: non-finite steps are skipped, counted and, past a limit, stop
the run with its last good checkpoint intact; a checkpoint of another model is one error
line that names the array and both shapes, and nothing is deleted."""

import json
import os
import shutil

import pytest

from support import SMALL_MODEL, run_train

FAST = [
    *SMALL_MODEL,
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.train.eval_batches=1',
]


def records(workdir):
    lines = (workdir / 'metrics.jsonl').read_text().splitlines()
    return {r['step']: r for r in map(json.loads, lines) if not r.get('eval')}


@pytest.fixture(scope='module')
def nan_run(tmp_path_factory, token_data):
    """Non-finite steps 3 and 4 past a limit of 2 (a checkpoint every 2 steps): (result,
    workdir)."""
    workdir = tmp_path_factory.mktemp('nan') / 'run'
    result = run_train(
        workdir,
        *FAST,
        '--config.train.steps=8',
        '--config.checkpoint.every=2',
        '--config.train.inject_nan_at_step=3',
        '--config.train.inject_nan_steps=2',
        '--config.train.max_consecutive_skips=2',
        data=token_data,
    )
    return result, workdir


def test_injected_nan_steps_are_skipped_counted_and_past_the_limit_stop_the_run(nan_run):
    result, workdir = nan_run
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith('error: 2 consecutive steps')
    logged = records(workdir)
    assert [logged[step]['skipped_steps'] for step in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert logged[2]['loss'] == logged[2]['loss'] and logged[3]['loss'] != logged[3]['loss']
    assert max(logged) == 4  # stopped at the step that reached the limit
    # The last good checkpoint (step 2) is kept, and nothing was saved after the skips.
    assert sorted(os.listdir(workdir / 'checkpoints')) == ['2']


def test_a_checkpoint_of_another_model_is_one_error_line_and_nothing_is_deleted(
    nan_run,
    tmp_path,
    token_data,
):
    """A copy of the NaN drill's workdir (its step-2 checkpoint of SMALL_MODEL: a train run
    fewer than a run of its own) resumed with twice the hidden size."""
    workdir = tmp_path / 'run'
    shutil.copytree(nan_run[1], workdir)
    assert sorted(os.listdir(workdir / 'checkpoints')) == ['2']
    # A workdir that records its run (identity.json) refuses another model before the
    # checkpoint is read (test_identity.py); one that does not (an import, an older run) is
    # held by the checkpoint's own shapes.
    (workdir / 'identity.json').unlink()
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob('*')}
    wider = run_train(
        workdir, *FAST, '--config.model.hidden=128', '--config.train.steps=4', data=token_data
    )
    assert wider.returncode == 2, wider.stderr[-3000:]
    error = [line for line in wider.stderr.splitlines() if line.startswith('error: ')]
    assert len(error) == 1 and wider.stderr.strip().splitlines()[-1] == error[0]
    assert 'params/blocks/attention/out_bias' in error[0]  # layers 4 (SMALL_MODEL) x hidden
    assert '(4, 64)' in error[0] and '(4, 128)' in error[0]
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob('*')} == before  # untouched


def test_a_loss_spike_rolls_back_to_the_last_checkpoint_and_skips_the_batches_past_it(
    tmp_path,
    token_data,
):
    workdir = tmp_path / 'run'
    result = run_train(
        workdir,
        *FAST,
        '--config.train.steps=8',
        '--config.checkpoint.every=2',
        '--config.train.spike_factor=3.0',
        '--config.train.spike_window=3',
        '--config.train.spike_skip_batches=2',
        '--config.train.inject_spike_at_step=6',  # reports 10 x its loss
        data=token_data,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'loss spike at step 6' in result.stdout
    assert 'rolled back to step 4, data moved on to sample 128' in result.stdout
    # 6 batches before the spike was seen, 2 skipped, then steps 5 to 8 again: step 6 is saved
    # only after the rollback, at 10 batches of 16; step 8 at 12.
    for step, batches in ((6, 10), (8, 12)):
        meta = json.loads((workdir / 'checkpoints' / str(step) / 'meta' / 'metadata').read_text())
        assert meta['samples_consumed'] == batches * 16
        assert meta['tokens_seen'] == step * 16 * 32  # what the model trained on
