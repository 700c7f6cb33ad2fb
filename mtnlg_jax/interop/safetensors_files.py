"""A Hugging Face model directory's safetensors, read and written tensor by tensor.

A model's weights are one `model.safetensors`, or, above a size, several files and an index
that names each tensor's file (what `save_pretrained` writes and the published 70B and 405B
checkpoints carry):

    model.safetensors.index.json   {"metadata": {"total_size": bytes},
                                    "weight_map": {tensor name: file name}}
    model-00001-of-00030.safetensors, ...

`Reader` opens them with the safetensors library (`safe_open`) and reads one tensor, or one
slice of one, at a time: a device's shard of a parameter is read straight from the file
(memory-mapped), so a 405B checkpoint converts on hosts that could not hold it whole.
`write` takes tensors one at a time and holds at most one output file's worth in memory.
"""

import json
import os

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16', which safetensors reads)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE = 'model.safetensors'
INDEX = 'model.safetensors.index.json'
# Above this many bytes the weights are split into several files (transformers' default
# max_shard_size is 5 GB too); a file may be larger when one tensor is.
DEFAULT_SHARD_BYTES = 5 * 1000**3
_DTYPES = {'BF16': 'bfloat16', 'F32': 'float32', 'F16': 'float16', 'F64': 'float64'}


class SafetensorsError(ValueError):
    """A missing, unreadable or inconsistent weights file; the message names the file."""


class Reader:
    """The tensors of a model directory (model.safetensors, or the files its index names),
    read on demand: `read(name, index)` returns a numpy array of that tensor or slice."""

    def __init__(self, directory):
        self.directory = directory
        self._handles = {}
        index_path = os.path.join(directory, INDEX)
        if os.path.isfile(index_path):
            self._file_of = _weight_map(index_path)
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            self._file_of = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            raise SafetensorsError(f'{directory}: neither {SINGLE} nor {INDEX} in it')

    def _open(self, file_name):
        handles = self._handles
        if file_name not in handles:
            path = os.path.join(self.directory, file_name)
            if not os.path.isfile(path):
                raise SafetensorsError(f'{path}: no such file (named by {INDEX})')
            try:
                handles[file_name] = safe_open(path, framework='numpy')
            except Exception as e:  # safetensors' error types vary with its version
                raise SafetensorsError(f'{path}: not a safetensors file ({e})') from None
        return handles[file_name]

    def names(self):
        return sorted(self._file_of)

    def __contains__(self, name):
        return name in self._file_of

    def _slice(self, name):
        if name not in self._file_of:
            raise SafetensorsError(f'{self.directory}: no tensor {name}')
        handle = self._open(self._file_of[name])
        try:
            return handle.get_slice(name)
        except Exception as e:
            path = os.path.join(self.directory, self._file_of[name])
            raise SafetensorsError(f'{path}: no readable tensor {name} ({e})') from None

    def shape(self, name):
        return tuple(self._slice(name).get_shape())

    def read(self, name, index=()):
        """Tensor `name`, or its slice `index` (a tuple of slices, one per leading axis), as
        numpy in its stored dtype (bfloat16 as ml_dtypes')."""
        tensor = self._slice(name)
        if not index:
            return np.asarray(tensor[:])
        shape = tuple(tensor.get_shape())
        lengths = [len(range(n)[s]) for n, s in zip(shape, index)] + list(shape[len(index) :])
        if 0 in lengths:  # safetensors refuses an empty slice at the end of an axis
            return np.zeros(lengths, _DTYPES.get(tensor.get_dtype(), tensor.get_dtype().lower()))
        return np.asarray(tensor[index])

    def close(self):
        self._handles.clear()  # safe_open's handles close when dropped

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _weight_map(index_path):
    try:
        with open(index_path) as f:
            weight_map = json.load(f)['weight_map']
        if not isinstance(weight_map, dict):
            raise TypeError('weight_map is not an object')
    except (ValueError, KeyError, TypeError) as e:
        raise SafetensorsError(f'{index_path}: not a safetensors index ({e})') from None
    return weight_map


def write(directory, tensors, max_shard_bytes=DEFAULT_SHARD_BYTES):
    """Write (name, numpy array) pairs, produced one at a time by the iterable `tensors`, as
    model.safetensors, or above max_shard_bytes as model-0000i-of-0000n.safetensors files and
    their index, as transformers' save_pretrained names them. Files are written under
    temporary names and renamed at the end, so a failure leaves no partial model (and the
    temporary files are removed). Returns the file names written."""
    os.makedirs(directory, exist_ok=True)
    temporary, pending, pending_bytes, weight_map, total = [], {}, 0, {}, 0

    def flush():
        path = os.path.join(directory, f'.model-part-{len(temporary)}.safetensors.tmp')
        temporary.append(path)
        save_file(pending, path, metadata={'format': 'pt'})
        for name in pending:
            weight_map[name] = len(temporary) - 1
        pending.clear()

    try:
        for name, value in tensors:
            value = np.ascontiguousarray(value)
            if pending and pending_bytes + value.nbytes > max_shard_bytes:
                flush()
                pending_bytes = 0
            pending[name] = value
            pending_bytes += value.nbytes
            total += value.nbytes
        if pending or not temporary:
            flush()
        count = len(temporary)
        names = [SINGLE] if count == 1 else [
            f'model-{i + 1:05d}-of-{count:05d}.safetensors' for i in range(count)
        ]  # fmt: skip
        for path, name in zip(temporary, names):
            os.replace(path, os.path.join(directory, name))
            _usual_mode(os.path.join(directory, name))
    except BaseException:
        for path in temporary:
            if os.path.exists(path):
                os.remove(path)
        raise
    # An earlier export's other form would shadow this one's in a loader: remove it.
    index_path = os.path.join(directory, INDEX)
    stale = index_path if count == 1 else os.path.join(directory, SINGLE)
    if os.path.exists(stale):
        os.remove(stale)
    if count == 1:
        return names
    index = dict(
        metadata=dict(total_size=total),
        weight_map={name: names[i] for name, i in sorted(weight_map.items())},
    )
    with open(index_path, 'w') as f:
        json.dump(index, f, indent=2)
    return names + [INDEX]


def _usual_mode(path):
    """safetensors writes through a private temporary file (mode 0600): give the weights the
    mode any other new file gets (0644 under the usual umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
