"""Invariants 3 and 4 of DESIGN.md at the command line: a stopped run resumes from its workdir
with the losses the uninterrupted run had, under the same layout or another."""

import json

import pytest

from support import SMALL_MODEL, run_train

RUN = [
    *SMALL_MODEL,
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.train.eval_batches=1',
    '--config.optimizer.warmup_tokens=2048',
    '--config.optimizer.decay_tokens=20000',  # fixed: the schedule must not depend on steps
]


def losses(workdir):
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return {r['step']: r['loss'] for r in records if not r.get('eval')}


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, token_data):
    workdir = tmp_path_factory.mktemp('straight')
    result = run_train(workdir, *RUN, '--config.train.steps=12', data=token_data)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(workdir)


def test_resume_same_layout_continues_with_identical_losses(tmp_path, token_data, uninterrupted):
    workdir = tmp_path / 'run'
    first = run_train(workdir, *RUN, '--config.train.steps=6', data=token_data)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(workdir, *RUN, '--config.train.steps=12', data=token_data)
    assert second.returncode == 0, second.stderr[-3000:]
    assert 'resumed      from step 6' in second.stdout
    assert losses(workdir) == uninterrupted  # every step, bit for bit


PIPELINED = [  # data 2 x stage 2 x tensor 2, circular with 2 repeats: layers in stage order
    '--config.mesh.data=2',
    '--config.mesh.stage=2',
    '--config.pipeline.repeats=2',
    '--config.train.micro_batch=2',
]
TENSOR_4 = ['--config.mesh.data=2', '--config.mesh.stage=1', '--config.mesh.tensor=4']


@pytest.mark.parametrize('before,after', [(PIPELINED, TENSOR_4), (TENSOR_4, PIPELINED)])
def test_resume_under_another_layout_continues_within_tolerance(
    tmp_path, token_data, uninterrupted, before, after
):
    """Across stage and repeats too: checkpoints hold the blocks in plain layer order."""
    workdir = tmp_path / 'run'
    first = run_train(workdir, *RUN, *before, '--config.train.steps=6', data=token_data)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(workdir, *RUN, *after, '--config.train.steps=12', data=token_data)
    assert second.returncode == 0, second.stderr[-3000:]
    assert 'resumed      from step 6' in second.stdout
    resumed = losses(workdir)
    assert sorted(resumed) == sorted(uninterrupted)
    for step in range(1, 13):  # the pipelined half, before or after, matches as well
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-4), step
