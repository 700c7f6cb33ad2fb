"""Megatron's indexed dataset: a `.bin` of token ids and an `.idx` saying where each sequence is.

Why this format: it is what Megatron-LM's `tools/preprocess_data.py` writes, so corpora
prepared for Megatron train here unchanged, and ours train there. Both files are memory-mapped:
opening a 300 B token corpus reads a few bytes of header, and a sample touches only its pages.

    <prefix>.idx  (little-endian)
        9 bytes   b"MMIDIDX\\x00\\x00"
        uint64    version = 1
        uint8     dtype code of the tokens (DTYPE_CODES)
        uint64    S, the number of sequences
        uint64    D, the number of document boundaries (documents + 1)
        int32[S]  sizes: tokens of each sequence
        int64[S]  pointers: byte offset of each sequence in .bin
        int64[D]  document boundaries as sequence indices: 0, ..., S
    <prefix>.bin  the sequences' tokens, concatenated, in that dtype

Our writer stores one sequence per document (as Megatron does without sentence splitting), so
its boundaries are 0, 1, ..., S. It streams: tokens go straight to `.bin`, sizes to a side
file, and the index is assembled from it in chunks, so memory stays flat however large the
corpus. Both files appear (by rename) only once complete.
"""

import os
import struct

import numpy as np

MAGIC = b'MMIDIDX\x00\x00'
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct('<9sQBQQ')  # magic, version, dtype code, sequences, boundaries
_CHUNK = 1 << 20  # entries per chunk when assembling an index


class DataError(ValueError):
    """Data that cannot be used: a missing, truncated or corrupt file; the message names it."""


def token_dtype(vocab_size):
    """uint16 when every id fits (vocabularies up to 65536 pieces), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def dtype_code(dtype):
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f'no Megatron dtype code for {np.dtype(dtype)}')


class IndexedDataset:
    """A read-only, memory-mapped `.bin`/`.idx` pair; DataError naming the file if it is bad."""

    def __init__(self, prefix):
        self.prefix = prefix
        idx_path, bin_path = prefix + '.idx', prefix + '.bin'
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f'{path}: no such file (launch/preprocess.py writes it)')
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, 'rb') as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[:9] != MAGIC:
            raise DataError(f'{idx_path}: not a Megatron index (bad magic or header)')
        _, version, code, sequences, boundaries = _HEADER.unpack(header)
        if version != VERSION:
            raise DataError(f'{idx_path}: index version {version}, expected {VERSION}')
        if code not in DTYPE_CODES:
            raise DataError(f'{idx_path}: unknown dtype code {code}')
        expected = _HEADER.size + 4 * sequences + 8 * sequences + 8 * boundaries
        if idx_bytes != expected:
            raise DataError(
                f'{idx_path}: {idx_bytes} bytes, but its header ({sequences} sequences, '
                f'{boundaries} document boundaries) needs {expected}: truncated or corrupt'
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(idx_path, mode='r', dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = index[offset : offset + 4 * sequences].view(np.int32)
        offset += 4 * sequences
        self.pointers = index[offset : offset + 8 * sequences].view(np.int64)
        offset += 8 * sequences
        self.document_index = index[offset : offset + 8 * boundaries].view(np.int64)
        self._check(idx_path, bin_path, sequences, boundaries)
        self.tokens = (
            np.memmap(bin_path, mode='r', dtype=self.dtype)
            if os.path.getsize(bin_path)
            else np.zeros(0, self.dtype)
        )

    def _check(self, idx_path, bin_path, sequences, boundaries):
        """Sizes, pointers and boundaries agree with each other and with the .bin's length."""
        bin_bytes = os.path.getsize(bin_path)
        itemsize = self.dtype.itemsize
        if sequences and (self.sizes.min() < 0 or self.pointers[0] != 0):
            raise DataError(f'{idx_path}: corrupt (negative size or first pointer not 0)')
        total = 0
        for start in range(0, sequences, _CHUNK):  # pointers are the running sum of sizes
            sizes = self.sizes[start : start + _CHUNK].astype(np.int64)
            expected = (total + np.concatenate([[0], np.cumsum(sizes)[:-1]])) * itemsize
            if not np.array_equal(self.pointers[start : start + _CHUNK], expected):
                raise DataError(f'{idx_path}: corrupt (pointers do not follow the sizes)')
            total += int(sizes.sum())
        if bin_bytes != total * itemsize:
            raise DataError(
                f'{bin_path}: {bin_bytes} bytes, but {idx_path} describes {total} tokens of '
                f'{self.dtype} ({total * itemsize} bytes): truncated or not its pair'
            )
        bounds = self.document_index
        if (
            boundaries < 1
            or bounds[0] != 0
            or bounds[-1] != sequences
            or np.any(np.diff(bounds) < 0)
        ):
            raise DataError(
                f'{idx_path}: corrupt (document boundaries must run from 0 to {sequences})'
            )
        self.num_tokens = total

    def __len__(self):
        """Number of sequences (documents, for files of our writer)."""
        return len(self.sizes)

    def __getitem__(self, i):
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin`/`.idx`: `add(ids)` per document, then `finish()`.
    Nothing appears under the final names until finish(); `abort()` removes the partial files."""

    def __init__(self, prefix, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        directory = os.path.dirname(prefix)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._tmp = {name: f'{prefix}.{name}.tmp{os.getpid()}' for name in ('bin', 'idx', 'sizes')}
        self._bin = open(self._tmp['bin'], 'wb')
        self._sizes = open(self._tmp['sizes'], 'wb')
        self.documents, self.tokens = 0, 0

    def add(self, ids):
        """Append one document's token ids (its eod token included, if it has one)."""
        self.add_documents(ids, [len(ids)])

    def add_documents(self, ids, lengths):
        """Append several documents at once: their ids concatenated, and each one's length."""
        self._bin.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self._sizes.write(np.asarray(lengths, dtype=np.int32).tobytes())
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths))

    def finish(self):
        """Write the index from the streamed sizes and move both files into place."""
        self._bin.close()
        self._sizes.close()
        count = self.documents
        sizes = np.memmap(self._tmp['sizes'], mode='r', dtype=np.int32) if count else []
        with open(self._tmp['idx'], 'wb') as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, count, count + 1))
            for start in range(0, count, _CHUNK):
                f.write(np.asarray(sizes[start : start + _CHUNK]).tobytes())
            total = 0
            for start in range(0, count, _CHUNK):
                chunk = np.asarray(sizes[start : start + _CHUNK], dtype=np.int64)
                pointers = total + np.concatenate([[0], np.cumsum(chunk)[:-1]])
                f.write((pointers * self.dtype.itemsize).astype(np.int64).tobytes())
                total += int(chunk.sum())
            for start in range(0, count + 1, _CHUNK):
                stop = min(start + _CHUNK, count + 1)
                f.write(np.arange(start, stop, dtype=np.int64).tobytes())
        del sizes
        os.remove(self._tmp['sizes'])
        os.replace(self._tmp['bin'], self.prefix + '.bin')
        os.replace(self._tmp['idx'], self.prefix + '.idx')

    def abort(self):
        for handle in (self._bin, self._sizes):
            handle.close()
        for path in self._tmp.values():
            if os.path.exists(path):
                os.remove(path)


def merge(prefixes, output_prefix, dtype, finish=IndexedDatasetWriter.finish):
    """Concatenate the datasets at `prefixes`, in order, into output_prefix.bin/.idx (what one
    writer fed their documents in that order would write); the writer, finish(writer) done."""
    writer = IndexedDatasetWriter(output_prefix, dtype)
    try:
        for prefix in prefixes:
            part = IndexedDataset(prefix)
            for start in range(0, len(part.sizes), _CHUNK):
                sizes = np.asarray(part.sizes[start : start + _CHUNK])
                first = int(part.pointers[start]) // part.dtype.itemsize if len(sizes) else 0
                writer.add_documents(part.tokens[first : first + int(sizes.sum())], sizes)
        finish(writer)
    except BaseException:
        writer.abort()
        raise
    return writer
