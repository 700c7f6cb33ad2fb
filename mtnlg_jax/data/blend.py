"""Weighted blends of datasets, in Megatron's order: the blend follows its weights exactly.

Megatron's blended dataset does not draw a source at random for each sample: sample i goes to
the source whose count lags its share the most, the largest `weight * (i + 1) - count so far`
(first source on ties). Every prefix of the blend is then within one sample of its weights,
and the order is a pure function of the weights, so a blend is as reproducible as its sources
(each shuffled by the seed). Megatron's helper measures the lag before the sample,
`weight * max(i, 1)`, which lets a source fall up to 1.2 samples behind; after it, as here,
keeps every count within one.

    weights 0.5 / 0.3 / 0.2:   0 0 1 0 2 1 0 0 1 2 ...   (source of samples 0, 1, 2, ...)

The assignment is prefix-stable: samples 0..n-1 do not depend on how many follow. It is
computed on demand, in doubling chunks, by the loop Megatron runs in C++ (a few microseconds
per sample here), and kept in memory.
"""

import threading

import numpy as np

_FIRST_CHUNK = 4096


class BlendedDataset:
    """`read(indices)` of a weighted blend of datasets that each have `read(indices)`."""

    def __init__(self, datasets, weights):
        weights = np.asarray(weights, dtype=np.float64)
        if len(datasets) != len(weights) or not len(weights) or np.any(weights <= 0):
            raise ValueError(f'need one positive weight per dataset, got {weights.tolist()}')
        self.datasets = list(datasets)
        self.weights = weights / weights.sum()
        self.seq_len = self.datasets[0].seq_len
        self._source = np.zeros(0, np.int32)  # which dataset sample i comes from
        self._position = np.zeros(0, np.int64)  # and which of that dataset's samples it is
        self._counts = [0] * len(self.datasets)
        self._lock = threading.Lock()

    def assignment(self, stop):
        """(source, position within the source) of samples 0 .. stop - 1."""
        with self._lock:
            if stop > len(self._source):
                self._extend(max(stop, 2 * len(self._source), _FIRST_CHUNK))
            return self._source[:stop], self._position[:stop]

    def _extend(self, size):
        weights, counts = self.weights.tolist(), self._counts
        others = range(1, len(weights))
        sources, positions = [], []
        for i in range(len(self._source), size):
            best, best_error = 0, weights[0] * (i + 1) - counts[0]
            for d in others:
                error = weights[d] * (i + 1) - counts[d]
                if error > best_error:
                    best, best_error = d, error
            sources.append(best)
            positions.append(counts[best])
            counts[best] += 1
        self._source = np.concatenate([self._source, np.asarray(sources, np.int32)])
        self._position = np.concatenate([self._position, np.asarray(positions, np.int64)])

    def read(self, indices):
        """Samples `indices` of the blend: int32 (k, seq_len + 1)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len + 1), np.int32)
        if not len(indices):
            return out
        source, position = self.assignment(int(indices.max()) + 1)
        source, position = source[indices], position[indices]
        for d, dataset in enumerate(self.datasets):
            chosen = source == d
            if chosen.any():
                out[chosen] = dataset.read(position[chosen])
        return out

    def samples(self, start, count):
        """Samples start .. start + count - 1: int32 (count, seq_len + 1)."""
        return self.read(np.arange(start, start + count))
