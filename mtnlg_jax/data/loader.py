"""The data seam between prepared token files and the trainer.

The trainer needs exactly two things from this module:

* :func:`read_token_file` -- the token stream of one split, memory-mapped;
* :class:`TokenWindowLoader` -- ``samples(start, count)``: the training
  samples ``start .. start+count-1`` of an infinite, shuffled sample stream.

Sample ``i`` is a pure function of ``(tokens, seq_len, seed, i)``.  The global
batch of step ``t`` with global batch size ``B`` is ``samples(t * B, B)``; it
therefore depends only on the seed and the number of samples consumed so far,
never on the device mesh, the number of hosts or micro-batching, and resuming
from a checkpoint only needs the consumed-sample count.  Keep that contract
when replacing the internals (a later issue swaps in Megatron indexed
datasets): callers should not depend on anything else here.
"""

from __future__ import annotations

import os

import numpy as np

# How many epoch permutations to keep; a batch spans at most two epochs
# unless the split is smaller than a batch.
_PERM_CACHE = 4


class DataError(Exception):
    """A token file is missing, malformed or too short; the message names it."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest dtype that holds every id: uint16 below 65536, else int32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def write_token_file(path: str, token_ids: np.ndarray) -> None:
    """Write a 1-D token array as ``.npy`` (atomically: tmp file + rename).

    The caller chooses the dtype (see :func:`token_dtype`); it is kept as is.
    """
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
        raise DataError(
            f"{path}: expected a 1-D integer array, got "
            f"{token_ids.dtype} of shape {token_ids.shape}"
        )
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, token_ids, allow_pickle=False)
    os.replace(tmp, path)


def read_token_file(path: str) -> np.ndarray:
    """Memory-map a token file written by :func:`write_token_file` (read-only)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such token file (run launch/prepare_data.py)")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a token file ({exc})") from exc
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(
            f"{path}: expected a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
        )
    return tokens


class TokenWindowLoader:
    """Shuffled, non-overlapping ``seq_len + 1`` token windows of a token stream.

    The stream is cut into ``n = (len(tokens) - 1) // seq_len`` windows; window
    ``w`` is ``tokens[w * seq_len : w * seq_len + seq_len + 1]`` (the extra
    token is the last target; consecutive windows share one boundary token).
    Epoch ``e`` visits every window once, in the order of the permutation
    ``np.random.default_rng([seed, e]).permutation(n)``; sample ``i`` is window
    ``perm_{i // n}[i % n]``.  Documents are not respected: windows run across
    eod tokens, as in Megatron's GPT dataset.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, *, source: str = "tokens"):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if np.ndim(tokens) != 1:
            raise DataError(f"{source}: expected a 1-D token array, got shape {np.shape(tokens)}")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{source}: {len(tokens)} tokens is shorter than one window "
                f"of seq_len+1={seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.source = source
        self._n = (len(tokens) - 1) // self.seq_len
        self._perms: dict[int, np.ndarray] = {}

    @classmethod
    def from_file(cls, path: str, seq_len: int, seed: int) -> "TokenWindowLoader":
        """A loader over :func:`read_token_file` ``(path)``; errors name ``path``."""
        return cls(read_token_file(path), seq_len, seed, source=path)

    @property
    def num_windows(self) -> int:
        """Windows per epoch (samples before the order is reshuffled)."""
        return self._n

    def window(self, w: int) -> np.ndarray:
        """Window ``w`` in stream order (unshuffled), as int32."""
        if not 0 <= w < self._n:
            raise IndexError(f"window {w} out of range [0, {self._n})")
        start = w * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)

    def window_index(self, i: int) -> int:
        """Which window sample ``i`` is."""
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        return int(self._perm(i // self._n)[i % self._n])

    def sample(self, i: int) -> np.ndarray:
        """Sample ``i`` of the stream: an int32 array of ``seq_len + 1`` tokens."""
        return self.window(self.window_index(i))

    def samples(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start+count-1`` stacked: int32 ``(count, seq_len + 1)``.

        Equal to stacking :meth:`sample`; may cross epoch boundaries.
        """
        if start < 0 or count < 0:
            raise IndexError(f"start and count must be >= 0, got {start}, {count}")
        idx = np.arange(start, start + count, dtype=np.int64)
        epochs = idx // self._n
        windows = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            windows[sel] = self._perm(int(e))[idx[sel] % self._n]
        offsets = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        # Fancy indexing a memory map touches only the pages of these windows.
        return np.asarray(self.tokens)[offsets].astype(np.int32)

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self._n)
            if len(self._perms) >= _PERM_CACHE:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm
