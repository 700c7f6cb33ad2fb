"""Sharded safetensors read and written tensor by tensor (mtnlg_jax/interop/safetensors_files.py),
against the files transformers itself wrote (tests/fixtures/hf_llama)."""

import json
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

from mtnlg_jax.interop import safetensors_files as st

FIXTURE = pathlib.Path(__file__).resolve().parent / 'fixtures' / 'hf_llama'


def test_the_sharded_fixture_reads_as_the_single_file_tensor_for_tensor():
    with st.Reader(FIXTURE / 'llama') as single, st.Reader(FIXTURE / 'llama_sharded') as sharded:
        assert single.names() == sharded.names()
        assert len(set(json.loads((FIXTURE / 'llama_sharded' / st.INDEX).read_text())
                       ['weight_map'].values())) == 3  # fmt: skip
        for name in single.names():
            a, b = single.read(name), sharded.read(name)
            assert a.dtype == ml_dtypes.bfloat16 and a.shape == single.shape(name)
            np.testing.assert_array_equal(a, b)


def test_a_slice_reads_the_rows_and_columns_of_the_whole_tensor():
    with st.Reader(FIXTURE / 'llama_sharded') as reader:
        name = 'model.layers.2.mlp.down_proj.weight'
        whole = reader.read(name)
        np.testing.assert_array_equal(reader.read(name, (slice(8, 24), slice(5, 40))),
                                      whole[8:24, 5:40])  # fmt: skip


@pytest.mark.parametrize('shard_bytes', [10**9, 300])
def test_written_tensors_read_back_bit_for_bit_in_one_file_or_shards(tmp_path, shard_bytes):
    rng = np.random.default_rng(0)
    tensors = {f'layer.{i}.weight': rng.standard_normal((8, 6)).astype(np.float32)
               for i in range(5)}  # fmt: skip
    tensors['embed'] = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    produced = []

    def one_at_a_time():
        for name, value in tensors.items():
            produced.append(name)
            yield name, value

    files = st.write(tmp_path, one_at_a_time(), shard_bytes)
    sharded = shard_bytes == 300
    assert (st.INDEX in files) == sharded and (len(files) > 2) == sharded
    assert not [f for f in os.listdir(tmp_path) if f.endswith('.tmp')]
    assert all(os.stat(tmp_path / f).st_mode & 0o044 for f in files)  # not safetensors' 0600
    with st.Reader(tmp_path) as reader:
        assert reader.names() == sorted(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(reader.read(name), value)
            assert reader.read(name).dtype == value.dtype
    if sharded:
        index = json.loads((tmp_path / st.INDEX).read_text())
        assert index['metadata']['total_size'] == sum(v.nbytes for v in tensors.values())
        assert all(size <= 300 + 8 * 6 * 4 + 200 for size in
                   [os.path.getsize(tmp_path / f) for f in files if f != st.INDEX])  # fmt: skip


def test_a_failed_write_leaves_no_weights_behind(tmp_path):
    def failing():
        yield 'a', np.zeros((100,), np.float32)
        yield 'b', np.zeros((100,), np.float32)
        raise OSError('disk full')

    with pytest.raises(OSError, match='disk full'):
        st.write(tmp_path, failing(), max_shard_bytes=400)
    assert os.listdir(tmp_path) == []


def test_a_resharded_export_removes_the_other_form(tmp_path):
    tensors = [(f't{i}', np.zeros((64,), np.float32)) for i in range(4)]
    st.write(tmp_path, iter(tensors), max_shard_bytes=300)
    assert (tmp_path / st.INDEX).exists()
    st.write(tmp_path, iter(tensors))
    assert not (tmp_path / st.INDEX).exists() and (tmp_path / st.SINGLE).exists()
    st.write(tmp_path, iter(tensors), max_shard_bytes=300)
    assert not (tmp_path / st.SINGLE).exists()


@pytest.mark.parametrize(
    'make, message',
    [
        (lambda d: None, 'neither model.safetensors nor'),
        (lambda d: (d / st.INDEX).write_text('{"weight_map": 3}'), 'not a safetensors index'),
        (lambda d: (d / st.INDEX).write_text('not json'), 'not a safetensors index'),
        (lambda d: (d / st.SINGLE).write_bytes(b'\x10\x00garbage'), 'not a safetensors file'),
    ],
)
def test_bad_weight_files_are_one_error_naming_the_file(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(st.SafetensorsError, match=message) as error:
        st.Reader(tmp_path)
    assert str(tmp_path) in str(error.value) and '\n' not in str(error.value)


def test_an_index_naming_a_missing_file_is_an_error_naming_it(tmp_path):
    (tmp_path / st.INDEX).write_text(json.dumps({'weight_map': {'w': 'model-1.safetensors'}}))
    with st.Reader(tmp_path) as reader, pytest.raises(st.SafetensorsError, match='model-1'):
        reader.read('w')
