"""GPT samples (Megatron's windows over shuffled documents, per epoch), the document split, and
the blend order that follows its weights within one sample at every prefix."""

import os
import time

import numpy as np
import pytest

from mtnlg_jax.data.blend import BlendedDataset
from mtnlg_jax.config.checks import parse_split
from mtnlg_jax.data.gpt_dataset import GPTDataset, split_ranges
from mtnlg_jax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from mtnlg_jax.data.megatron_order import MegatronGPTDataset

SEQ_LEN = 16
MTNLG_WEIGHTS = [19.3, 15.7, 14.3, 13.0, 9.4, 9.0, 5.7, 4.8, 2.9, 1.6, 1.4, 1.0, 0.9, 0.9, 0.2]


@pytest.fixture
def indexed(tmp_path):
    """300 documents of 1 to 40 tokens; token values are unique positions, so windows show."""
    rng = np.random.default_rng(0)
    writer, position = IndexedDatasetWriter(str(tmp_path / 'docs'), np.int32), 0
    for _ in range(300):
        length = int(rng.integers(1, 40))
        writer.add(np.arange(position, position + length))
        position += length
    writer.finish()
    return IndexedDataset(str(tmp_path / 'docs'))


def test_samples_are_consecutive_windows_of_the_shuffled_epoch_stream(indexed):
    dataset = GPTDataset(indexed, (10, 250), SEQ_LEN, seed=3)
    n = dataset.samples_per_epoch
    assert n == (sum(len(indexed[d]) for d in range(10, 250)) - 1) // SEQ_LEN
    for epoch in range(3):
        doc_idx, _, shuffle_idx = dataset.epoch_index(epoch)
        assert sorted(doc_idx.tolist()) == list(range(10, 250))  # each document once
        stream = np.concatenate([indexed[d] for d in doc_idx])
        want = np.stack([stream[w * SEQ_LEN : w * SEQ_LEN + SEQ_LEN + 1] for w in shuffle_idx])
        got = dataset.read(np.arange(epoch * n, (epoch + 1) * n))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
        assert sorted(shuffle_idx.tolist()) == list(range(n))  # each window once per epoch


def assert_windows_of_the_stream(sizes, doc_idx, shuffle_idx, samples, seq_len):
    """samples[i] = tokens [w seq_len, w seq_len + seq_len] of the documents of doc_idx
    concatenated, w = shuffle_idx[i] (the definition, by a plain concatenation), where
    document d's tokens are its positions in the file (sizes: the documents' lengths)."""
    tokens, starts = np.arange(sizes.sum(), dtype=np.int32), np.cumsum(sizes) - sizes
    stream = np.concatenate([tokens[starts[d] : starts[d] + sizes[d]] for d in doc_idx.tolist()])
    for sample, w in zip(samples, np.asarray(shuffle_idx, dtype=np.int64)):
        np.testing.assert_array_equal(sample, stream[w * seq_len : (w + 1) * seq_len + 1])


def test_the_index_at_sequence_131072_over_short_documents_builds_in_bounded_time(tmp_path):
    """200,000 documents of 1 to 79 tokens (8 M tokens: 61 windows of 131,072 + 1 an epoch,
    each spanning some 3,300 documents): both orders' indices build in under 2 s (measured
    0.04 s: numpy over the documents and the windows, nothing per token; bench/long_index.py
    times a corpus of 10 M documents), and every sample is the definition's window."""
    seq_len, rng = 131072, np.random.default_rng(0)
    sizes = rng.integers(1, 80, 200_000)
    writer = IndexedDatasetWriter(str(tmp_path / 'short'), np.int32)
    writer.add_documents(np.arange(sizes.sum(), dtype=np.int32), sizes)  # tokens: positions
    writer.finish()
    indexed = IndexedDataset(str(tmp_path / 'short'))
    start = time.perf_counter()
    ours = GPTDataset(indexed, (0, len(sizes)), seq_len, seed=5, cache=False)
    doc_idx, sample_idx, shuffle_idx = ours.epoch_index(0)
    n = ours.samples_per_epoch
    # n + 3 samples: two epochs, the second shuffled apart (it gives under 0.8 of its windows)
    megatron = MegatronGPTDataset(indexed, (0, len(sizes)), seq_len, 5, n + 3, cache=False)
    megatron_doc_idx, _, megatron_shuffle_idx = megatron.index()
    seconds = time.perf_counter() - start
    assert seconds < 2, seconds
    assert n == (sizes.sum() - 1) // seq_len == 61 and megatron.separate_last
    assert np.diff(np.asarray(sample_idx)[:, 0]).min() > 1000  # each window spans documents
    assert_windows_of_the_stream(sizes, doc_idx, shuffle_idx, ours.read(np.arange(n)), seq_len)
    samples = megatron.read(np.arange(len(megatron)))
    assert_windows_of_the_stream(sizes, megatron_doc_idx, megatron_shuffle_idx, samples, seq_len)


def test_epochs_are_reshuffled_and_the_seed_decides_the_order(indexed):
    a = GPTDataset(indexed, (0, 300), SEQ_LEN, seed=1, cache=False)
    b = GPTDataset(indexed, (0, 300), SEQ_LEN, seed=1, cache=False)
    c = GPTDataset(indexed, (0, 300), SEQ_LEN, seed=2, cache=False)
    n = a.samples_per_epoch
    np.testing.assert_array_equal(a.read(np.arange(3 * n)), b.read(np.arange(3 * n)))
    assert not np.array_equal(a.read(np.arange(n)), c.read(np.arange(n)))
    assert not np.array_equal(a.read(np.arange(n)), a.read(np.arange(n, 2 * n)))


def test_index_arrays_are_cached_next_to_the_data_and_reused(indexed):
    first = GPTDataset(indexed, (0, 300), SEQ_LEN, seed=0)
    samples = first.read(np.arange(2 * first.samples_per_epoch))
    cache = os.path.join(os.path.dirname(indexed.prefix), 'index-cache')
    assert len([f for f in os.listdir(cache) if f.endswith('_idx.npy')]) == 6  # 3 per epoch
    second = GPTDataset(indexed, (0, 300), SEQ_LEN, seed=0)
    assert isinstance(second.epoch_index(0)[0], np.memmap)  # loaded, not rebuilt
    np.testing.assert_array_equal(second.read(np.arange(len(samples))), samples)


def test_document_split_follows_megatron_rounding():
    assert split_ranges('969,30,1', 1189) == dict(
        train=(0, 1152), valid=(1152, 1188), test=(1188, 1189)
    )
    assert split_ranges('98,2', 200) == dict(train=(0, 196), valid=(196, 200), test=(200, 200))
    assert split_ranges('1/1/1', 10) == dict(train=(0, 4), valid=(4, 7), test=(7, 10))
    for bad in ('', 'a,b', '1,-1', '0,0,0', '1,1,1,1'):
        with pytest.raises(ValueError):
            parse_split(bad)


def test_a_split_shorter_than_one_sample_is_a_data_error_naming_the_file(indexed):
    with pytest.raises(DataError, match=f'{indexed.prefix}: its valid split .* data.split'):
        GPTDataset(indexed, (0, 1), 64, seed=0, name='valid')


class Source:
    """A stand-in dataset whose sample k of source s is [s, k]."""

    seq_len = 1

    def __init__(self, source):
        self.source = source

    def read(self, indices):
        return np.stack([np.full(len(indices), self.source), indices], axis=1).astype(np.int32)


@pytest.mark.parametrize(
    'weights',
    [MTNLG_WEIGHTS, [0.5, 0.5], [1.0], [0.7, 0.2, 0.1], *np.random.default_rng(0).random((4, 5))],
)
def test_blend_counts_follow_the_weights_within_one_sample_at_every_prefix(weights):
    blend = BlendedDataset([Source(s) for s in range(len(weights))], weights)
    source, _ = blend.assignment(20_000)
    counts = np.cumsum(np.eye(len(weights))[source], axis=0)
    shares = np.arange(1, 20_001)[:, None] * np.asarray(weights) / np.sum(weights)
    bound = 1 - 1 / (2 * len(weights) - 2) if len(weights) > 1 else 0  # Tijdeman's
    assert np.abs(counts - shares).max() <= bound + 1e-9 < 1


def test_blend_reads_each_source_in_order_and_is_prefix_stable():
    blend = BlendedDataset([Source(0), Source(1), Source(2)], [0.5, 0.3, 0.2])
    samples = blend.samples(0, 1000)
    for s in range(3):  # each source's samples come in order 0, 1, 2, ...
        mine = samples[samples[:, 0] == s, 1]
        np.testing.assert_array_equal(mine, np.arange(len(mine)))
    fresh = BlendedDataset([Source(0), Source(1), Source(2)], [0.5, 0.3, 0.2])
    np.testing.assert_array_equal(fresh.samples(700, 300), samples[700:])  # no history needed
    np.testing.assert_array_equal(fresh.read([5, 3, 999]), samples[[5, 3, 999]])
    assert samples[:10, 0].tolist() == [0, 1, 0, 2, 0, 1, 0, 2, 1, 0]
