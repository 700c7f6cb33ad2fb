"""data.order = megatron gives Megatron-LM's sample order exactly: its index arrays and samples
equal those megatron-core 0.16.1 itself made (tests/fixtures/megatron_order/make_golden.py) for
one source and a 3-source blend, one epoch and three with the last epoch shuffled apart or not,
train, valid and test splits; and a config's steps, batch and ramp-up size it as Megatron-LM's."""

import pathlib

import numpy as np
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.data import megatron_order
from mtnlg_jax.data.gpt_dataset import SPLIT_NAMES
from mtnlg_jax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from mtnlg_jax.config import rampup
from mtnlg_jax.train import banner

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'megatron_order'
EDGE = 'sample_index_empty_documents'
CASES = sorted(p.stem for p in FIXTURES.glob('*.npz') if p.stem not in ('corpus', EDGE))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """The generator's three sources, written by our writer: (prefix, IndexedDataset) each."""
    directory, lengths = tmp_path_factory.mktemp('megatron'), np.load(FIXTURES / 'corpus.npz')
    sources = []
    for d in range(len(lengths.files)):
        sizes = lengths[f'lengths{d}']
        ids = (np.arange(sizes.sum(), dtype=np.int64) + 10007 * d) % 50000  # as the generator
        prefix = str(directory / f'source{d}')
        writer = IndexedDatasetWriter(prefix, np.uint16)
        writer.add_documents(ids, sizes)
        writer.finish()
        sources.append((prefix, IndexedDataset(prefix)))
    return sources


def test_the_golden_cases_cover_one_and_three_epochs_with_the_last_apart_and_not():
    kinds = set()
    for case in CASES:
        golden = np.load(FIXTURES / f'{case}.npz')
        assert str(golden['megatron_core']) == '0.16.1'
        for d in range(len(golden['sources'])):
            doc_idx = golden[f'train_{d}_document_index']
            documents = np.unique(doc_idx)
            epochs = len(doc_idx) // len(documents)
            # shuffled apart, the last epoch is the documents once each (else almost never)
            apart = np.array_equal(np.sort(doc_idx[-len(documents) :]), documents)
            kinds.add((len(golden['sources']), epochs, epochs > 1 and apart))
    for sources in (1, 3):
        assert {(sources, 1, False), (sources, 3, True), (sources, 3, False)} <= kinds


@pytest.mark.parametrize('case', CASES)
def test_index_arrays_and_samples_equal_megatron_cores(corpus, case):
    golden = np.load(FIXTURES / f'{case}.npz')
    weights = golden['weights'].tolist() or [1.0]
    sources = [(w, corpus[s][1]) for w, s in zip(weights, golden['sources'])]
    splits = megatron_order.open_splits(
        sources,
        str(golden['split']),
        int(golden['seq_len']),
        int(golden['seed']),
        golden['sizes'].tolist(),
    )
    assert sorted(splits) == sorted(SPLIT_NAMES)
    for name in SPLIT_NAMES:
        blend, n = splits[name], int(golden[f'{name}_length'])
        assert len(blend) == n, name
        if len(sources) > 1:
            source, position = blend.assignment(n)
            np.testing.assert_array_equal(source, golden[f'{name}_dataset_index'])
            np.testing.assert_array_equal(position, golden[f'{name}_dataset_sample_index'])
        for d, dataset in enumerate(blend.datasets):
            for part, ours in zip(('document', 'sample', 'shuffle'), dataset.index()):
                want = golden[f'{name}_{d}_{part}_index']
                np.testing.assert_array_equal(ours, want, err_msg=f'{name} {d} {part}')
                assert part == 'sample' or ours.dtype == want.dtype
        head, tail = np.arange(min(32, n)), np.arange(max(0, n - 32), n)
        np.testing.assert_array_equal(blend.read(head), golden[f'{name}_first32'], err_msg=name)
        np.testing.assert_array_equal(blend.read(tail), golden[f'{name}_last32'], err_msg=name)
    with pytest.raises(DataError, match='past the'):
        splits['train'].read([len(splits['train'])])


def test_the_sample_index_steps_over_empty_documents_but_row_0_as_megatrons_cpp():
    golden = np.load(FIXTURES / f'{EDGE}.npz')
    sizes, doc_idx = golden['sizes'], golden['document_index']
    ours = megatron_order.sample_index(
        sizes, doc_idx, int(golden['seq_len']), int(sizes[doc_idx].sum())
    )
    assert sizes[doc_idx[0]] == 0
    np.testing.assert_array_equal(ours, golden['sample_index'])


def test_a_configs_steps_batch_and_rampup_size_the_splits_as_megatron_lm(corpus):
    """blend_three_epochs_last_joint is Megatron-LM's --train-samples 1968 --global-batch-size 16
    --rampup-batch-size 8 8 64 --eval-iters 1 --eval-interval 50 (127 iterations): here 127
    steps of a batch ramped from 8 to 16 over 64 samples."""
    golden = np.load(FIXTURES / 'blend_three_epochs_last_joint.npz')
    config = config_lib.defaults()
    config.mesh.update(dict(data=8, stage=1, tensor=1))
    config.model.update(dict(num_layers=1, hidden=64, heads=8, seq_len=16, vocab_size=50_000))
    config.train.update(
        dict(global_batch=16, micro_batch=1, steps=127, eval_every=50, eval_batches=1, seed=1234)
    )
    config.train.rampup.update(dict(start=8, increment=8, tokens=64 * 16))
    config.data.update(
        order='megatron',
        split=str(golden['split']),
        sources=tuple((w, corpus[s][0]) for w, s in zip(golden['weights'], golden['sources'])),
    )
    config = config_lib.resolve(config, 8)
    total = rampup.total_samples(config.train, config.model.seq_len)
    assert megatron_order.split_sizes(config, total) == tuple(golden['sizes'].tolist())
    splits = loader_lib.open_datasets(config)
    assert banner.data_lines(config, splits['train'])[1] == (
        "order        megatron: Megatron-LM's GPTDataset/BlendedDataset order for this run's "
        '1,968 train samples (epochs per source: 3, 2, 1)'
    )
    for name in SPLIT_NAMES:
        want = golden[f'{name}_first32']
        np.testing.assert_array_equal(splits[name].read(np.arange(len(want))), want, err_msg=name)
