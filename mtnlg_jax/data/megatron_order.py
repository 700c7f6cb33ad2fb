"""data.order = megatron: Megatron-LM's own sample order, index for index.

For continuing a Megatron-LM run here, or comparing loss curves with one batch for batch. Its
GPTDataset builds ONE index over all the epochs a run needs, sized by the run's sample count
(so the order depends on the run's length, unlike data.order = layout_independent):

    E          smallest number of epochs whose tokens cover num_samples x seq_len + 1
    rng        np.random.RandomState(seed), one generator for the three arrays in turn
    doc_idx    the split's documents E times, shuffled together (int32); when the last epoch
               gives fewer than 0.8 of an epoch's samples it is shuffled on its own after
               the first E - 1
    sample_idx (n + 1, 2) windows of seq_len + 1 tokens over that stream, n = (E T - 1) //
               seq_len (the same windows as gpt_dataset.py's, cut across epoch boundaries)
    shuffle_idx the n windows shuffled (uint32); with a separate last epoch its windows are
               shuffled apart from the others'

A blend (more than one source) is Megatron's BlendedDataset: each source's GPTDataset is asked
for ceil(ceil(size x w) x 1.005) samples, the blend holds sum(ceil(size x w)) and gives
sample i to the source whose w x max(i, 1) - count is largest (ties: the first source).
One source is Megatron's unweighted `--data-path PREFIX`: that GPTDataset alone. The sizes of
the train, valid and test splits are those Megatron-LM's training asks for (see split_sizes).

The sample index is built with numpy (searchsorted) instead of Megatron's C++ helper, and the
blend's greedy rule by a plain loop computed on demand (it is prefix-stable): tests check both
against arrays megatron-core itself made (tests/fixtures/megatron_order/).
"""

import math

import numpy as np

from mtnlg_jax.data.blend import BlendedDataset
from mtnlg_jax.config.checks import parse_split
from mtnlg_jax.data.gpt_dataset import SPLIT_NAMES, GPTDataset
from mtnlg_jax.data.indexed import DataError

MID_LEVEL_SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus: each source's extra samples
SEPARATE_LAST_EPOCH_BELOW = 0.80  # of an epoch's samples


def normalize(weights):
    """Megatron's normalize: float64 weights over their numpy sum, as a list."""
    weights = np.asarray(weights, dtype=np.float64)
    return (weights / np.sum(weights)).tolist()


def split_ranges(split, count):
    """Megatron's split matrix: {name: [start, stop) documents, or None for a zero share}."""
    bounds = [0.0]
    for share in normalize(parse_split(split)):
        bounds.append(bounds[-1] + share)
    return {
        name: (round(lo * float(count)), round(hi * float(count))) if hi > lo else None
        for name, lo, hi in zip(SPLIT_NAMES, bounds[:-1], bounds[1:])
    }


def split_sizes(config, total_train_samples):
    """(train, valid, test) samples as Megatron-LM's get_train_valid_test_num_samples: the run's
    samples (ramp-up included, Megatron's --train-samples); (train_iters // eval_interval + 1)
    x eval_iters global batches; eval_iters global batches. train.eval_every = 0 (no periodic
    evaluation) counts as one final evaluation."""
    train_cfg = config.train
    evaluations = (train_cfg.steps // train_cfg.eval_every if train_cfg.eval_every else 0) + 1
    batches = train_cfg.eval_batches * train_cfg.global_batch
    return total_train_samples, evaluations * batches, batches


def num_epochs(tokens_per_epoch, num_samples, seq_len):
    """Megatron's _get_num_epochs: epochs whose tokens cover num_samples x seq_len + 1."""
    return max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch, num_samples, seq_len):
    """(epochs, whether the last one is shuffled apart, samples of the epochs before it)."""
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_len)
    if epochs == 1:
        return epochs, False, 0
    before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
    per_epoch = (tokens_per_epoch - 1) // seq_len
    from_last = num_samples - before_last
    return epochs, from_last < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch), before_last


def document_index(documents, epochs, rng, separate_last):
    """Megatron's _build_document_index: the documents `epochs` times, shuffled (int32)."""
    if separate_last and epochs > 1:
        first = document_index(documents, epochs - 1, rng, False)
        return np.concatenate([first, document_index(documents, 1, rng, False)])
    doc_idx = np.tile(np.asarray(documents), epochs).astype(np.int32)
    rng.shuffle(doc_idx)
    return doc_idx


def sample_index(sizes, doc_idx, seq_len, total_tokens):
    """Megatron's build_sample_idx (drop the last partial sample): row s = (position in doc_idx,
    offset) of stream token s x seq_len. A token lies in exactly one non-empty document, which
    searchsorted(side='right') finds past any empty ones, as the C++ loop skips them; only row 0
    is (0, 0) even when doc_idx[0] is empty, as the loop starts there."""
    num_samples = (total_tokens - 1) // seq_len
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx], dtype=np.int64)])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    in_doc = np.searchsorted(starts, positions, side='right') - 1
    index = np.stack([in_doc, positions - starts[in_doc]], axis=1)
    index[0] = 0
    return index


def shuffle_index(first_part, total, rng):
    """Megatron's _build_shuffle_index: [0, first_part) shuffled, then [first_part, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first_part, dtype=dtype)
    rng.shuffle(head)
    if first_part == total:
        return head
    tail = np.arange(first_part, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def within(indices, length, what):
    """indices as int64; DataError if one is outside the `length` samples Megatron built."""
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) and (indices.min() < 0 or indices.max() >= length):
        raise DataError(
            f'{what}: sample {int(indices.max())} is past the {length} that data.order=megatron '
            f'built for this run (Megatron sizes its index by train.steps and the batch)'
        )
    return indices


class MegatronGPTDataset(GPTDataset):
    """One split of one source with Megatron's index for `num_samples` samples.

    read(indices) -> int32 (k, seq_len + 1); len() = all windows of the E epochs
    (>= num_samples)."""

    def __init__(self, indexed, documents, seq_len, seed, num_samples, name='train', cache=True):
        self.num_samples = num_samples
        super().__init__(indexed, documents, seq_len, seed, name, cache)
        self.epochs, self.separate_last, self._before_last = separate_last_epoch(
            self.num_tokens, num_samples, seq_len
        )
        self._length = (self.epochs * self.num_tokens - 1) // seq_len
        self._index = None

    def _require_samples(self):
        # Megatron repeats a split shorter than one sample; it only needs tokens to repeat.
        if self.num_tokens < 2 and self.num_samples:
            self._too_short()

    def __len__(self):
        return self._length

    def index(self):
        """(doc_idx, sample_idx, shuffle_idx), built once and cached next to the data."""
        with self._lock:
            if self._index is None:
                self._index = self._cached(
                    self._build_index, order='megatron', num_samples=self.num_samples
                )
            return self._index

    def _build_index(self):
        rng = np.random.RandomState(self.seed)
        documents = np.arange(self.first, self.stop, dtype=np.int32)
        doc_idx = document_index(documents, self.epochs, rng, self.separate_last)
        sample_idx = sample_index(
            self.indexed.sizes, doc_idx, self.seq_len, self.epochs * self.num_tokens
        )
        first_part = self._before_last if self.separate_last else self._length
        return doc_idx, sample_idx, shuffle_index(first_part, self._length, rng)

    def read(self, indices):
        indices = within(indices, self._length, f'{self.indexed.prefix} ({self.name})')
        doc_idx, sample_idx, shuffle_idx = self.index()
        return self._windows(doc_idx, sample_idx, np.asarray(shuffle_idx)[indices].astype(np.int64))


class MegatronBlendedDataset(BlendedDataset):
    """Megatron's BlendedDataset of `size` samples: its greedy source rule (see the module
    docstring); with one dataset, that dataset itself (sample i is its sample i)."""

    def __init__(self, datasets, weights, size):
        # Megatron normalizes the weights once in its builder and again in BlendedDataset; the
        # base class normalizes once more, so normalizing here gives Megatron's floats.
        super().__init__(datasets, normalize(weights))
        self.size = size

    def __len__(self):
        return self.size

    def _rule(self):
        weights, others = self.weights.tolist(), range(1, len(self.weights))

        def choose(i, counts):
            x = float(max(i, 1))
            best, best_error = 0, weights[0] * x - counts[0]
            for d in others:
                error = weights[d] * x - counts[d]
                if error > best_error:
                    best, best_error = d, error
            return best

        return choose

    def read(self, indices):
        return super().read(within(indices, self.size, 'the blend'))


def open_splits(sources, split, seq_len, seed, sizes):
    """{'train', 'valid', 'test'} -> MegatronBlendedDataset (splits with no share, and a test split
    of no documents, left out), as Megatron-LM builds them from --data-path W1 P1 W2 P2 ..
    (or one unweighted P), --split, --seq-length, --seed and the split sizes.
    sources: ((weight, IndexedDataset), ...)."""
    weights = normalize([weight for weight, _ in sources])
    splits = {}
    for s, name in enumerate(SPLIT_NAMES):
        size = sizes[s]
        if len(sources) == 1:
            wanted, total = [size], size
        else:
            wanted = [math.ceil(size * w) for w in weights]
            total = sum(wanted)
            wanted = [int(math.ceil(n * (1 + MID_LEVEL_SURPLUS))) for n in wanted]
        datasets = []
        for (_, indexed), num_samples in zip(sources, wanted):
            documents = split_ranges(split, len(indexed))[name]
            if documents is None or (name == 'test' and documents[0] == documents[1]):
                break  # no share; or a test split of no documents (Megatron-LM would hang)
            datasets.append(
                MegatronGPTDataset(indexed, documents, seq_len, seed, num_samples, name)
            )
        else:
            if len(sources) == 1:
                total = len(datasets[0])
            splits[name] = MegatronBlendedDataset(datasets, weights, total)
    return splits
