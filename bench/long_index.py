"""Megatron's sample index at long sequences over many short documents: build seconds.

    python bench/long_index.py [--documents 10000000] [--seq 2048 8192 131072]

A corpus of `--documents` documents of 1 to 79 tokens (uint16, written to a temporary
folder), then for each sequence length: the seconds to build one epoch's index of the default
order (gpt_dataset.GPTDataset: doc_idx, sample_idx, shuffle_idx), of data.order = megatron
for two epochs (megatron_order.MegatronGPTDataset), and to read one global batch of 16
samples. No cache: every figure is a fresh build. Prints a markdown table.
"""

import argparse
import tempfile
import time

import numpy as np

from mtnlg_jax.data.gpt_dataset import GPTDataset
from mtnlg_jax.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtnlg_jax.data.megatron_order import MegatronGPTDataset


def corpus(folder, documents):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 80, documents)
    writer = IndexedDatasetWriter(f'{folder}/short', np.uint16)
    writer.add_documents(rng.integers(0, 50000, int(sizes.sum()), dtype=np.uint16), sizes)
    writer.finish()
    return IndexedDataset(f'{folder}/short')


def seconds(work):
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def row(indexed, seq_len):
    documents = (0, len(indexed))
    ours_s, ours = seconds(lambda: GPTDataset(indexed, documents, seq_len, 1, cache=False))
    epoch_s, _ = seconds(lambda: ours.epoch_index(0))
    n = ours.samples_per_epoch
    megatron = MegatronGPTDataset(indexed, documents, seq_len, 1, 2 * n, cache=False)
    megatron_s, _ = seconds(megatron.index)
    read_s, _ = seconds(lambda: megatron.read(np.arange(16)))
    return (
        f'| {seq_len:,} | {n:,} | {ours_s + epoch_s:.2f} | {megatron.epochs} | {megatron_s:.2f} '
        f'| {read_s:.2f} |'
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--documents', type=int, default=10_000_000)
    parser.add_argument('--seq', type=int, nargs='+', default=[2048, 8192, 131072])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_s, indexed = seconds(lambda: corpus(folder, args.documents))
        tokens = int(np.asarray(indexed.sizes).sum(dtype=np.int64))
        print(f'corpus: {len(indexed):,} documents, {tokens:,} tokens, written in {build_s:.1f} s')
        print(
            '| seq | windows an epoch | default order: one epoch s | megatron epochs '
            '| megatron index s | read 16 samples s |'
        )
        print('| --- | --- | --- | --- | --- | --- |')
        for seq_len in args.seq:
            print(row(indexed, seq_len), flush=True)


if __name__ == '__main__':
    main()
