"""The loader: the same global batches under every layout and after a restart from a consumed
count (invariant 1 of docs/design.md), each process reading only its own rows, and data errors."""

import shutil

import jax
import numpy as np
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.config import keys
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.data.indexed import IndexedDatasetWriter
from mtnlg_jax.parallel.mesh import make_mesh, mesh_from_config
from support import SMALL_MODEL, run_train

SEQ_LEN = 8
STEPS = 7


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
    """Two indexed datasets whose tokens are their positions (+ 10000 for the second)."""
    rng = np.random.default_rng(0)
    prefixes = []
    for name, base in (('a', 0), ('b', 10_000)):
        prefix = str(tmp_path_factory.mktemp('data') / name)
        writer, position = IndexedDatasetWriter(prefix, np.int32), base
        for _ in range(120):
            length = int(rng.integers(2, 30))
            writer.add(np.arange(position, position + length))
            position += length
        writer.finish()
        prefixes.append(prefix)
    return prefixes


def config_for(sources, data, tensor, micro_batch, order='layout_independent'):
    config = config_lib.defaults()
    config.mesh.update(dict(data=data, stage=1, tensor=tensor))
    config.model.update(dict(num_layers=1, hidden=64, heads=8, seq_len=SEQ_LEN, vocab_size=20_000))
    config.train.update(dict(global_batch=32, micro_batch=micro_batch, steps=STEPS))
    # 8, 8, 16, 24, then 32: the ramp's 48 samples in 3 increments of 16.
    config.train.rampup.update(dict(start=8, increment=8, tokens=48 * SEQ_LEN))
    config.data.sources = ((0.7, sources[0]), (0.3, sources[1]))
    config.data.order = order
    return config_lib.resolve(config, data * tensor)


def run_batches(config, samples_consumed=0, steps=STEPS):
    """[(samples consumed, global batch, micro-steps, host tokens (B, seq + 1))] of `steps`."""
    mesh = mesh_from_config(config)
    train = loader_lib.open_datasets(config)['train']
    batches = loader_lib.TrainBatches(config, train, mesh, samples_consumed)
    seen = []
    for _ in range(steps):
        batch = next(batches)
        tokens = np.asarray(batch.tokens)
        assert tokens.shape == (
            batch.micro_steps,
            batch.global_batch // batch.micro_steps,
            SEQ_LEN + 1,
        )
        np.testing.assert_array_equal(
            np.asarray(batch.row_ids).ravel(), np.arange(batch.global_batch)
        )
        seen.append(
            (
                batch.samples_consumed,
                batch.global_batch,
                batch.micro_steps,
                tokens.reshape(batch.global_batch, -1),
            )
        )
    batches.close()
    return seen, train


@pytest.mark.parametrize('order', keys.choices('data.order'))
def test_global_batches_are_the_same_under_every_layout_and_follow_the_ramp(sources, order):
    runs = {
        layout: run_batches(config_for(sources, *layout, order=order))
        for layout in [(4, 2, 2), (8, 1, 1), (1, 8, 8), (4, 2, 1)]  # data, tensor, micro_batch
    }
    reference, train = runs[(4, 2, 2)]
    assert [b for _, b, _, _ in reference] == [8, 8, 16, 24, 32, 32, 32]
    assert [m for _, _, m, _ in reference] == [1, 1, 2, 3, 4, 4, 4]
    assert [m for _, _, m, _ in runs[(4, 2, 1)][0]] == [2, 2, 4, 6, 8, 8, 8]
    consumed = 0
    for samples_consumed, batch, _, tokens in reference:
        assert samples_consumed == consumed
        np.testing.assert_array_equal(tokens, train.samples(consumed, batch))
        consumed += batch
    for layout, (seen, _) in runs.items():
        for (c, b, _, tokens), (c_ref, b_ref, _, tokens_ref) in zip(seen, reference):
            assert (c, b) == (c_ref, b_ref), layout
            np.testing.assert_array_equal(tokens, tokens_ref, err_msg=str(layout))
    both = np.concatenate([tokens for *_, tokens in reference])
    assert (both < 10_000).any() and (both >= 10_000).any()  # both sources appear


@pytest.mark.parametrize('order', keys.choices('data.order'))
def test_a_restart_from_a_consumed_count_continues_with_the_same_batches(sources, order):
    config = config_for(sources, 4, 2, 2, order=order)
    straight, _ = run_batches(config)
    restarted, _ = run_batches(config, samples_consumed=straight[3][0], steps=STEPS - 3)
    for (c, b, m, tokens), (c_ref, b_ref, m_ref, tokens_ref) in zip(restarted, straight[3:]):
        assert (c, b, m) == (c_ref, b_ref, m_ref)
        np.testing.assert_array_equal(tokens, tokens_ref)


def test_each_process_reads_only_the_rows_of_its_own_shards():
    mesh = make_mesh(data=4, tensor=2)
    shape = (2, 8, SEQ_LEN + 1)  # 2 micro-steps x 8 rows: 2 rows per data replica per micro-step
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, 'data', None))
    # Two processes of 4 devices each: process p holds data replicas 2p and 2p + 1.
    by_data = {p: loader_lib.process_rows(sharding, shape, p, lambda d: d.id // 4) for p in (0, 1)}
    assert by_data[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]  # rows m * 8 + r, r in 0..3
    assert by_data[1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    # Tensor halves on different processes: both hold a piece of every replica, so read all.
    by_tensor = {p: loader_lib.process_rows(sharding, shape, p, lambda d: d.id % 2) for p in (0, 1)}
    assert by_tensor[0].tolist() == by_tensor[1].tolist() == list(range(16))
    assert loader_lib.process_rows(sharding, shape, 0).tolist() == list(range(16))  # here: 1


def test_a_reader_error_surfaces_in_the_training_loop(sources):
    config = config_for(sources, 4, 2, 2)

    class Broken:
        seq_len = SEQ_LEN

        def read(self, indices):
            raise OSError('disk gone')

    batches = loader_lib.TrainBatches(config, Broken(), make_mesh(data=4, tensor=2), 0)
    with pytest.raises(OSError, match='disk gone'):
        next(batches)
    batches.close()


@pytest.mark.parametrize(
    'data,key',
    [
        (dict(sources=()), 'data.sources'),
        (dict(sources=((0, 'x'),)), 'data.sources'),
        (dict(sources=(('x', 1.0),)), 'data.sources'),
        (dict(split='1,0'), 'data.split'),
        (dict(split='a,b'), 'data.split'),
        (dict(order='shuffled'), 'data.order'),
    ],
)
def test_bad_data_keys_are_config_errors(sources, data, key):
    config = config_for(sources, 4, 2, 2)
    config.data.update(data)
    with pytest.raises(config_lib.ConfigError, match=key.replace('.', r'\.')):
        config_lib.resolve(config, 8)


def test_a_truncated_data_file_stops_the_trainer_with_one_error_line(tmp_path, token_data):  # noqa: F811
    prefix = str(tmp_path / 'pattern')
    for suffix in ('.bin', '.idx'):
        shutil.copy(token_data + suffix, prefix + suffix)
    with open(prefix + '.bin', 'r+b') as f:
        f.truncate(1000)
    result = run_train(tmp_path / 'run', *SMALL_MODEL, data=prefix)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f'error: {prefix}.bin: ') and 'truncated' in lines[0]
    assert not (tmp_path / 'run').exists()
