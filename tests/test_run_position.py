"""The training loop's parts that are plain functions: the run position and the metrics record."""

import collections

import numpy as np
import pytest

from mtnlg_jax.train import resume
from mtnlg_jax.train.periodic import due
from mtnlg_jax.train.reporter import step_record
from support import SEQ_LEN, small_config

Batch = collections.namedtuple('Batch', 'global_batch micro_steps')


def test_a_step_advances_the_position_by_its_batch():
    start = resume.Position(
        4, 'state 4', dict(samples_consumed=64, tokens_seen=2048, skipped_steps=1)
    )
    after = start.after('state 5', global_batch=16, seq_len=SEQ_LEN)
    assert after == resume.Position(
        5, 'state 5', dict(samples_consumed=80, tokens_seen=2048 + 16 * SEQ_LEN, skipped_steps=1)
    )
    assert start.counters['samples_consumed'] == 64  # positions are values
    assert after.counted(3).counters == dict(after.counters, skipped_steps=3)


def test_step_record_is_the_interval_mean_and_rates():
    config = small_config(data=2, stage=2, tensor=2, micro_steps=4)
    position = resume.Position(
        10, None, dict(samples_consumed=160, tokens_seen=5120, skipped_steps=2)
    )
    metrics = dict(lr=np.float32(1e-3), grad_norm=np.float32(0.5))
    throughput = (0.5, 1000.0), 6e6, 100.0  # (s/step, tokens/s), FLOPs/token, peak TFLOP/s
    record = step_record(config, position, Batch(16, 4), [2.0, 4.0], metrics, throughput)
    assert record['step'] == 10 and record['loss'] == 3.0
    assert record['tokens_seen'] == 5120 and record['skipped_steps'] == 2
    assert record['global_batch'] == 16 and record['step_time_s'] == 0.5
    assert record['tflops_per_device'] == pytest.approx(6e6 * 1000 / 8 / 1e12)
    assert record['mfu'] == pytest.approx(record['tflops_per_device'] / 100.0)
    assert 0 < record['pipeline_bubble_fraction'] < 1
    no_peak = step_record(config, position, Batch(16, 4), [1.0], metrics, ((0.5, 1e3), 6e6, None))
    assert no_peak['mfu'] is None


def test_step_record_of_a_mixture_of_experts_holds_its_balance():
    """Per layer, the largest expert load over the mean; the dropped share of all choices."""
    config = small_config()
    position = resume.Position(1, None, dict(samples_consumed=16, tokens_seen=512, skipped_steps=0))
    loads = np.array([[4.0, 4.0, 4.0, 4.0], [8.0, 4.0, 2.0, 2.0]], np.float32)
    metrics = dict(
        lr=np.float32(1e-3),
        grad_norm=np.float32(0.5),
        moe_aux_loss=np.float32(0.02),
        moe_z_loss=np.float32(0.0),
        moe_loads=loads,
        moe_dropped=np.float32(8.0),
    )
    record = step_record(config, position, Batch(16, 2), [2.0], metrics, ((0.5, 1e3), 6e6, None))
    assert record['moe_layer_load_max_over_mean'] == [1.0, 2.0]
    assert record['moe_load_max_over_mean'] == 2.0 and record['moe_dropped_fraction'] == 0.25
    assert record['moe_aux_loss'] == pytest.approx(0.02)
    dense = dict(lr=np.float32(1e-3), grad_norm=np.float32(0.5))
    assert not any(
        k.startswith('moe')
        for k in step_record(config, position, Batch(16, 2), [2.0], dense, ((0.5, 1e3), 6e6, None))
    )


def test_due_on_every_multiple_and_the_last_step():
    assert [s for s in range(1, 11) if due(4, s, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if due(0, s, 10)] == [10]
