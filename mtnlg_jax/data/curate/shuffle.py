"""Curation's shuffle: fn over the rows of each key value, a task per value, through a folder.

    map     each block's rows, cut by key, one parquet file per value it holds:
                FOLDER/VVVVV/<digest of the file's bytes>.parquet
            (a retried task writes the same names again, each file renamed into place whole)
    reduce  a task per value: its folder's files, in name order -> fn(rows)

Why not Ray Data's sort or groupby: their map tasks return one object per block and
partition, and the driver owns every one of them (about 5 KB each there; Ray's own estimate
is 3 KB). Blocks and partitions both grow with the corpus, so the driver grew with its square:
7,691 objects at once in fuzzy deduplication with 3.2 GB's block counts, and at 10^8
documents (5,000 partitions of 20,000) millions. Here the driver holds one
small row per map block and one per value. The folder is the work folder's, so on a cluster
it is on the file system every node sees, as the rest of the work folder already is.
"""

import hashlib
import os
import shutil

import numpy as np


def grouped(dataset, key, values, fn, through, beating=None, **fn_kwargs):
    """fn(the rows of one `key` value, **fn_kwargs) for each of `values` (sorted ints; a key
    goes with the largest value not above it, as a sort cuts) that has rows, a task holding
    that value's rows alone: what a task holds is bounded by the largest group. The map half
    runs now, into the folder `through` (emptied first); the Dataset returned runs the reduce
    half. `beating` wraps the map half's function (the run's heartbeat; fn comes wrapped)."""
    import ray

    values = np.asarray(list(values), np.int64)
    shutil.rmtree(through, ignore_errors=True)
    spill = dict(key=key, values=values, folder=through)
    spill_fn = beating(_spill) if beating else _spill
    dataset.map_batches(
        spill_fn, batch_size=None, batch_format='pyarrow', fn_kwargs=spill
    ).materialize()
    keys = ray.data.from_items(
        [{key: int(v)} for v in values], override_num_blocks=max(len(values), 1)
    )
    gather = dict(key=key, folder=through, fn=fn, fn_kwargs=fn_kwargs)
    return keys.map_batches(_gather, batch_size=1, batch_format='numpy', fn_kwargs=gather)


def _folder_of(folder, value):
    return os.path.join(folder, f'{int(value):05d}')


def _spill(table, key, values, folder):
    import pyarrow as pa  # noqa: PLC0415 (a Ray worker's imports)
    import pyarrow.parquet as pq  # noqa: PLC0415

    at = np.maximum(np.searchsorted(values, table[key].to_numpy(), side='right') - 1, 0)
    order = np.argsort(at, kind='stable')
    table, at = table.take(order), at[order]
    starts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]]) if len(at) else []
    for start, end in zip(starts, [*starts[1:], len(at)]):
        sink = pa.BufferOutputStream()
        pq.write_table(table.slice(start, end - start), sink)
        data = sink.getvalue()
        # Named by its bytes: a task retried after a partial run rewrites its files, never
        # adds rows (no two blocks of a shuffle here hold the same rows).
        target = _folder_of(folder, values[at[start]])
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, hashlib.sha1(data).hexdigest()[:24] + '.parquet')
        with open(f'{path}.{os.getpid()}.tmp', 'wb') as f:
            f.write(data)
        os.replace(f'{path}.{os.getpid()}.tmp', path)
    return {'rows': np.array([len(at)], np.int64)}


def _gather(batch, key, folder, fn, fn_kwargs):
    target = _folder_of(folder, batch[key][0])
    files = sorted(os.listdir(target)) if os.path.isdir(target) else []
    files = [f for f in files if f.endswith('.parquet')]  # (not a killed task's .tmp)
    if not files:  # a value no row has
        return
    rows = _rows([os.path.join(target, f) for f in files], key)
    keys = rows[key]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    for start, end in zip(starts, [*starts[1:], len(keys)]):
        yield fn({k: v[start:end] for k, v in rows.items()}, **fn_kwargs)


def _rows(paths, key):
    """The rows of the parquet files `paths` as numpy columns, in `key` order (stable). A file's
    Arrow table is let go once its columns are numpy, so that what the task holds is the
    columns fn reads (text as Python bytes), not those and an Arrow copy beside them."""
    import pyarrow.parquet as pq  # noqa: PLC0415 (a Ray worker's imports)
    from ray.data.block import BlockAccessor  # noqa: PLC0415

    tables = [BlockAccessor.for_block(pq.read_table(p)).to_batch_format('numpy') for p in paths]
    rows = {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}
    del tables
    if np.any(rows[key][1:] < rows[key][:-1]):
        order = np.argsort(rows[key], kind='stable')
        rows = {k: v[order] for k, v in rows.items()}
    return rows
