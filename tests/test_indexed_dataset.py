"""The Megatron .bin/.idx format: our writer and reader, files from an independent writer made
from the format description, and the one-line errors of truncated or corrupt files."""

import struct

import numpy as np
import pytest

from mtnlg_jax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, token_dtype


def documents(count=50, vocab=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 30)) for _ in range(count)]


def write(prefix, docs, dtype=np.uint16):
    writer = IndexedDatasetWriter(str(prefix), dtype)
    for doc in docs:
        writer.add(doc)
    writer.finish()
    return str(prefix)


def write_like_megatron(prefix, sequences, document_bounds, dtype_code, dtype):
    """An independent writer, straight from the format in docs/reference.md."""
    with open(f'{prefix}.bin', 'wb') as f:
        for sequence in sequences:
            f.write(np.asarray(sequence, dtype=dtype).tobytes())
    sizes = [len(s) for s in sequences]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * np.dtype(dtype).itemsize
    with open(f'{prefix}.idx', 'wb') as f:
        f.write(b'MMIDIDX\x00\x00')
        f.write(struct.pack('<Q', 1))
        f.write(struct.pack('<B', dtype_code))
        f.write(struct.pack('<Q', len(sequences)))
        f.write(struct.pack('<Q', len(document_bounds)))
        f.write(struct.pack(f'<{len(sizes)}i', *sizes))
        f.write(struct.pack(f'<{len(sizes)}q', *pointers.tolist()))
        f.write(struct.pack(f'<{len(document_bounds)}q', *document_bounds))
    return str(prefix)


@pytest.mark.parametrize('vocab_size', [8192, 100_000])
def test_written_documents_read_back_identically(tmp_path, vocab_size):
    docs = documents(vocab=vocab_size)
    dataset = IndexedDataset(write(tmp_path / 'd', docs, token_dtype(vocab_size)))
    assert dataset.dtype == (np.uint16 if vocab_size <= 65536 else np.int32)
    assert len(dataset) == len(docs) and dataset.num_tokens == sum(map(len, docs))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(dataset[i], doc)
    np.testing.assert_array_equal(dataset.document_index, np.arange(len(docs) + 1))


def test_our_files_match_the_independent_writer_byte_for_byte(tmp_path):
    docs = documents()
    ours = write(tmp_path / 'ours', docs)
    theirs = write_like_megatron(
        tmp_path / 'theirs', docs, list(range(len(docs) + 1)), 8, np.uint16
    )
    for suffix in ('.bin', '.idx'):
        assert open(ours + suffix, 'rb').read() == open(theirs + suffix, 'rb').read(), suffix


def test_megatron_files_with_sentence_split_documents_read_back(tmp_path):
    sequences = documents(count=7, vocab=70_000)
    bounds = [0, 2, 3, 7]  # three documents of 2, 1 and 4 sequences (--split-sentences)
    dataset = IndexedDataset(write_like_megatron(tmp_path / 'm', sequences, bounds, 4, np.int32))
    assert dataset.dtype == np.int32 and len(dataset) == 7
    np.testing.assert_array_equal(dataset.document_index, bounds)
    for i, sequence in enumerate(sequences):
        np.testing.assert_array_equal(dataset[i], sequence)


def corrupt(path, offset, data):
    with open(path, 'r+b') as f:
        f.seek(offset)
        f.write(data)


def truncate(path, by):
    with open(path, 'r+b') as f:
        f.truncate(f.seek(0, 2) - by)


@pytest.mark.parametrize(
    'damage,file,message',
    [
        (lambda p: truncate(p + '.idx', 8), '.idx', 'truncated or corrupt'),
        (lambda p: truncate(p + '.bin', 2), '.bin', 'truncated or not its pair'),
        (lambda p: corrupt(p + '.idx', 0, b'XXIDIDX'), '.idx', 'bad magic'),
        (lambda p: corrupt(p + '.idx', 9, struct.pack('<Q', 2)), '.idx', 'version 2'),
        (lambda p: corrupt(p + '.idx', 17, b'\x09'), '.idx', 'dtype code 9'),
        (lambda p: corrupt(p + '.idx', 34 + 4 * 50 + 8 * 3, b'\x07'), '.idx', 'pointers'),
        (lambda p: corrupt(p + '.idx', 34 + 4 * 50 + 8 * 50, b'\x05'), '.idx', 'boundaries'),
        (lambda p: open(p + '.idx', 'wb').close(), '.idx', 'bad magic'),
    ],
)
def test_damaged_files_are_a_data_error_naming_the_file(tmp_path, damage, file, message):
    prefix = write(tmp_path / 'd', documents())
    damage(prefix)
    with pytest.raises(DataError, match=message) as error:
        IndexedDataset(prefix)
    assert str(error.value).startswith(prefix + file + ':')
    assert '\n' not in str(error.value)


def test_a_missing_pair_is_a_data_error_naming_the_file(tmp_path):
    with pytest.raises(DataError, match=f'{tmp_path}/none.idx: no such file'):
        IndexedDataset(str(tmp_path / 'none'))


def test_an_aborted_writer_leaves_earlier_files_as_they_were(tmp_path):
    prefix = write(tmp_path / 'd', documents())
    before = open(prefix + '.bin', 'rb').read(), open(prefix + '.idx', 'rb').read()
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add([1, 2, 3])
    writer.abort()
    assert (open(prefix + '.bin', 'rb').read(), open(prefix + '.idx', 'rb').read()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['d.bin', 'd.idx']
