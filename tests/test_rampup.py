"""Batch-size ramp-up: the schedule of batch sizes and micro-steps, its config checks, and a run
whose metrics keep samples, tokens and the token-based learning rate exact."""

import json

import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.config import rampup
from mtnlg_jax.train.optimizer import learning_rate_schedule
from test_loader import SEQ_LEN, config_for, sources  # noqa: F401
from support import SMALL_MODEL, run_train


def test_the_ramp_schedule_of_batch_sizes(sources):  # noqa: F811
    train_cfg = config_for(sources, 4, 2, 2).train
    assert rampup.schedule(train_cfg, SEQ_LEN, 7) == [8, 8, 16, 24, 32, 32, 32]
    assert rampup.schedule(train_cfg, SEQ_LEN, 3, samples_consumed=16) == [16, 24, 32]
    assert rampup.total_samples(train_cfg, SEQ_LEN) == 8 + 8 + 16 + 24 + 32 * 3
    assert rampup.stages(train_cfg) == [8, 16, 24, 32]
    mtnlg = config_lib.load('configs/mtnlg_530b.py').train
    batches = rampup.schedule(mtnlg, 2048, 20_000)
    assert (
        batches[0] == 32
        and batches[-1] == 1920
        and sorted(set(batches)) == list(range(32, 1921, 32))
    )
    ramp_samples = 12e9 / 2048
    assert sum(b for b in batches if b < 1920) == pytest.approx(ramp_samples, rel=0.01)


@pytest.mark.parametrize(
    'ramp,key',
    [
        (dict(start=12, increment=8, tokens=100), 'train.rampup.start'),  # 12 % (2 x 4)
        (dict(start=8, increment=4, tokens=100), 'train.rampup.increment'),  # 4 % 8
        (dict(start=8, increment=16, tokens=100), 'train.rampup.increment'),  # 8 + 16k != 32
        (dict(start=40, increment=8, tokens=100), 'train.rampup.start'),  # above the batch
        (dict(start=8, increment=8, tokens=0), 'train.rampup.tokens'),
    ],
)
def test_a_ramp_that_does_not_split_into_micro_steps_is_a_config_error(sources, ramp, key):  # noqa: F811
    config = config_for(sources, 4, 2, 2)
    config.train.rampup.update(ramp)
    with pytest.raises(config_lib.ConfigError, match=key.replace('.', r'\.')):
        config_lib.resolve(config, 8)


def test_a_ramped_run_logs_exact_batches_tokens_and_learning_rates(tmp_path, token_data):  # noqa: F811
    workdir = tmp_path / 'run'
    result = run_train(
        workdir,
        *SMALL_MODEL,
        '--config.train.rampup.start=8',
        '--config.train.rampup.increment=8',
        '--config.train.rampup.tokens=512',  # 16 samples of 32 tokens: 8, 8, then 16
        '--config.train.steps=4',
        '--config.train.log_every=1',
        '--config.train.eval_every=0',
        '--config.train.eval_batches=1',
        '--config.optimizer.warmup_tokens=1000',
        '--config.optimizer.decay_tokens=0',  # 0: the run's tokens, counted with the ramp
        data=token_data,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'ramp-up      global batch 8 -> 16 by 8 over the first 512 tokens' in result.stdout
    assert 'compiled     train step for 2 micro-steps (global batch 16)' in result.stdout
    config = config_lib.load('configs/tiny.py')
    config.optimizer.update(dict(warmup_tokens=1000, decay_tokens=(8 + 8 + 16 + 16) * 32))
    schedule = learning_rate_schedule(config.optimizer)
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    train = [r for r in records if not r.get('eval')]
    assert [r['global_batch'] for r in train] == [8, 8, 16, 16]
    assert [r['tokens_seen'] for r in train] == [256, 512, 1024, 1536]
    for record in train:
        assert record['lr'] == pytest.approx(float(schedule(record['tokens_seen'])), rel=1e-6)
    saved = json.loads((workdir / 'config.json').read_text())
    assert saved['optimizer']['decay_tokens'] == 1536  # the run's tokens, ramp included
