"""GPT samples as Megatron's GPT dataset makes them: windows over shuffled documents.

A split is a contiguous range of an indexed dataset's documents (Megatron's `--split
969,30,1`). Each epoch of it is Megatron's index for one epoch, built with numpy instead of
Megatron's C++ helper:

    doc_idx      the split's documents, shuffled
    sample_idx   (n + 1, 2): (position in doc_idx, offset in that document) where sample s
                 starts; sample s is the seq_len + 1 tokens from start s to start s + 1
                 inclusive, so neighbours share one token and windows run across documents
    shuffle_idx  the n samples of the epoch, shuffled

    epoch stream  |doc 7 ....|doc 2 ..|doc 9 .......|doc 4 ...|...
    samples       [ 0     ][ 1     ][ 2     ][ 3     ]          seq_len tokens apart, +1
    sample i  =   epoch i // n, window shuffle_idx[i % n] of it

with n = (tokens of the split - 1) // seq_len. Epoch e shuffles with
`np.random.RandomState([seed, e])`, documents first, then samples, as Megatron does with its
one generator; the few tokens after the last whole window of an epoch are not used. Unlike
Megatron, which sizes its index by the run's sample count, every epoch stands alone: sample i
is a function of (data, split, seq_len, seed, i) only, so lengthening a run or resuming it
never reorders the data it has already seen. The three arrays of an epoch are cached as .npy
in `index-cache/` next to the data, keyed by a hash of what they depend on. (data.order =
megatron: megatron_order.py builds Megatron's own index instead, on these windows and cache.)
"""

import functools
import hashlib
import json
import os
import threading

import numpy as np

from mtnlg_jax.config.checks import parse_split
from mtnlg_jax.data.indexed import DataError

CACHE_FORMAT = 1
SPLIT_NAMES = ('train', 'valid', 'test')


def split_ranges(split, count):
    """Megatron's document split: three [start, stop) ranges over `count` documents."""
    weights = parse_split(split)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / sum(weights) * count)))
    bounds = [b - (bounds[-1] - count) if i else 0 for i, b in enumerate(bounds)]
    return dict(zip(SPLIT_NAMES, zip(bounds[:-1], bounds[1:])))


def split_tokens(indexed, split, data_split):
    """All tokens of one split's documents (or of every document when split is None),
    concatenated in document order: what perplexity and the n-gram baselines score."""
    first, stop = split_ranges(data_split, len(indexed))[split] if split else (0, len(indexed))
    if stop <= first:
        raise DataError(f'its {split} split (data.split {data_split}) has no documents')
    return np.concatenate([indexed[i] for i in range(first, stop)])


class GPTDataset:
    """Samples of one split of an indexed dataset: `read(indices)` -> int32 (k, seq_len + 1)."""

    def __init__(self, indexed, documents, seq_len, seed, name='train', cache=True):
        self.indexed, self.seq_len, self.seed, self.name = indexed, seq_len, seed, name
        self.first, self.stop = documents
        self.num_documents = self.stop - self.first
        self.num_tokens = int(indexed.sizes[self.first : self.stop].sum(dtype=np.int64))
        self.samples_per_epoch = max(0, (self.num_tokens - 1) // seq_len)
        self._require_samples()
        self._cache_dir = os.path.join(os.path.dirname(indexed.prefix) or '.', 'index-cache')
        self._use_cache = cache
        self._lock = threading.Lock()
        self._epoch_index = functools.lru_cache(maxsize=4)(self._load_or_build)

    def _require_samples(self):
        if self.samples_per_epoch < 1:
            self._too_short()

    def _too_short(self):
        raise DataError(
            f'{self.indexed.prefix}: its {self.name} split ({self.num_documents} documents, '
            f'{self.num_tokens} tokens) is shorter than one sample of seq_len + 1 = '
            f'{self.seq_len + 1} tokens (see data.split)'
        )

    def epoch_index(self, epoch):
        """(doc_idx, sample_idx, shuffle_idx) of one epoch."""
        with self._lock:
            return self._epoch_index(epoch)

    def _build(self, epoch):
        rng = np.random.RandomState([self.seed, epoch])
        doc_idx = np.arange(self.first, self.stop, dtype=np.int64)
        rng.shuffle(doc_idx)
        starts = np.concatenate([[0], np.cumsum(self.indexed.sizes[doc_idx], dtype=np.int64)])
        positions = np.arange(self.samples_per_epoch + 1, dtype=np.int64) * self.seq_len
        in_doc = np.searchsorted(starts, positions, side='right') - 1
        sample_idx = np.stack([in_doc, positions - starts[in_doc]], axis=1)
        shuffle_idx = np.arange(self.samples_per_epoch, dtype=np.int64)
        rng.shuffle(shuffle_idx)
        return doc_idx, sample_idx, shuffle_idx

    def _cache_paths(self, parts):
        idx_path = os.path.abspath(self.indexed.prefix + '.idx')
        stat = os.stat(idx_path)
        key = dict(
            format=CACHE_FORMAT,
            idx=idx_path,
            idx_bytes=stat.st_size,
            idx_mtime_ns=stat.st_mtime_ns,
            documents=[self.first, self.stop],
            seq_len=self.seq_len,
            seed=self.seed,
            **parts,
        )
        digest = hashlib.md5(json.dumps(key, sort_keys=True).encode()).hexdigest()
        stem = os.path.join(self._cache_dir, f'{os.path.basename(self.indexed.prefix)}-{digest}')
        return [f'{stem}-{part}_idx.npy' for part in ('doc', 'sample', 'shuffle')]

    def _load_or_build(self, epoch):
        return self._cached(lambda: self._build(epoch), epoch=epoch)

    def _cached(self, build, **parts):
        """build() -> (doc_idx, sample_idx, shuffle_idx), kept as .npy under a key of `parts`
        and what every index depends on (the data file, the documents, seq_len, seed)."""
        if not self._use_cache:
            return build()
        paths = self._cache_paths(parts)
        if all(os.path.exists(p) for p in paths):
            return tuple(np.load(p, mmap_mode='r') for p in paths)
        arrays = build()
        try:
            os.makedirs(self._cache_dir, exist_ok=True)
            for path, array in zip(paths, arrays):
                tmp = f'{path}.tmp{os.getpid()}-{threading.get_ident()}.npy'
                np.save(tmp, array)
                os.replace(tmp, path)
        except OSError:
            pass  # read-only data: the index is rebuilt in memory each time, which is correct
        return arrays

    def read(self, indices):
        """Samples `indices` (any non-negative ints, epochs repeating), int32 (k, seq_len + 1)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len + 1), np.int32)
        epochs = indices // self.samples_per_epoch
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            doc_idx, sample_idx, shuffle_idx = self.epoch_index(int(epoch))
            windows = np.asarray(shuffle_idx)[indices[chosen] % self.samples_per_epoch]
            out[chosen] = self._windows(doc_idx, sample_idx, windows)
        return out

    def _windows(self, doc_idx, sample_idx, windows):
        """Tokens of unshuffled windows, gathered as runs of (document, start, length)."""
        first, last = np.asarray(sample_idx[windows]), np.asarray(sample_idx[windows + 1])
        pieces = last[:, 0] - first[:, 0] + 1  # documents each window touches
        piece_start = np.repeat(np.cumsum(pieces) - pieces, pieces)
        step = np.arange(pieces.sum()) - piece_start
        position = np.repeat(first[:, 0], pieces) + step
        documents = np.asarray(doc_idx)[position]
        is_first, is_last = step == 0, step == np.repeat(pieces - 1, pieces)
        begin = np.where(is_first, np.repeat(first[:, 1], pieces), 0)
        end = np.where(is_last, np.repeat(last[:, 1], pieces) + 1, self.indexed.sizes[documents])
        length = end - begin
        base = self.indexed.pointers[documents] // self.indexed.dtype.itemsize + begin
        offset = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
        addresses = np.repeat(base, length) + offset
        return self.indexed.tokens[addresses].reshape(len(windows), self.seq_len + 1)
