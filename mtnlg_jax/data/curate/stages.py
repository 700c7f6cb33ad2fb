"""The curation stages as functions of one batch of rows: what each Ray task runs.

Each takes and returns a dict of numpy columns (Ray Data's numpy batch format) and calls only
the pure functions of exact.py, fuzzy.py, quality.py and decontaminate.py, so a stage gives
the same rows whatever the workers, blocks or partitions (rows are put in index order first
wherever an order could matter). Nothing here imports Ray.

    signature_rows(piece)      index, piece, size, hash, fp0, fp1 (exact), sig (MinHash)
    exact_groups(part)         + kept: the index its exact group keeps (itself if kept)
    band_rows(rows)            one row per (document, band): the band's rows of the signature
    bucket_members(part)       the members of buckets of two or more documents
    candidate_shingles(piece)  + shingles (uint32 bytes) of those members, read from the piece
    verified_edges(part)       per bucket: pairs in index order, exact Jaccard, a local
                               union-find skipping pairs already joined -> edges >= threshold
"""

import hashlib
import time

import numpy as np

from mtnlg_jax.data import pieces as pieces_lib
from mtnlg_jax.data.curate import exact, fuzzy
from mtnlg_jax.data.curate.text import _mix


def _texts(piece, json_key):
    found = list(pieces_lib.read(piece, (json_key,)))
    return np.array([i for i, _ in found], np.int64), [t for _, (t,) in found]


def _sorted(batch, key='index'):
    order = np.argsort(batch[key], kind='stable')
    return {k: v[order] for k, v in batch.items()}


def signature_rows(piece, options, parts):
    """The rows of pass 1 for one piece (a dict of pieces.numbered)."""
    index, texts = _texts(piece, options.json_key)
    started, n = time.process_time(), len(texts)
    fingerprints = np.stack([exact.fingerprint(t) for t in texts]) if n else np.zeros((0, 2))
    fingerprints = fingerprints.astype(np.uint64)
    exact_s = time.process_time() - started
    signatures = np.zeros((n, 1), np.uint32)
    if 'fuzzy' in options.stages and n:
        signer = fuzzy.Signer(options.num_perm, options.seed)
        signatures = np.stack([signer(fuzzy.shingles(t, options.shingle_words)) for t in texts])
    fuzzy_s = time.process_time() - started - exact_s
    share = 1 / max(n, 1)
    return {
        'index': index,
        'piece': np.full(n, piece['piece'], np.int64),
        'size': np.array([len(t.encode('utf-8')) for t in texts], np.int64),
        'hash': np.array([exact.content_hash(t) for t in texts], np.uint64),
        'fp0': fingerprints[:, 0],
        'fp1': fingerprints[:, 1],
        'sig': signatures.astype(np.uint32),
        'part': (fingerprints[:, 0] % np.uint64(parts)).astype(np.int64),
        'exact_s': np.full(n, exact_s * share),
        'fuzzy_s': np.full(n, fuzzy_s * share),
    }


def exact_groups(batch):
    """All rows of some exact groups, each given `kept`: the index of its group's survivor."""
    batch = _sorted(batch)
    fingerprints = np.stack([batch['fp0'], batch['fp1']], 1)
    _, kept = exact.duplicates(fingerprints, batch['size'], batch['hash'])
    return {**batch, 'kept': batch['index'][kept]}


def _bucket_key(band, values):
    """uint64 of (band, the band's rows), for the partition only (buckets compare in full)."""
    h = _mix(np.full(len(values), band + 1, np.uint64))
    for column in values.T:
        h = _mix(h ^ column.astype(np.uint64))
    return h


def band_rows(batch, bands, rows, parts):
    """One row per surviving document and band: its bucket (band, rows of the signature)."""
    alive = batch['kept'] == batch['index']
    out = {k: [] for k in ('index', 'piece', 'size', 'hash', 'band', 'bucket', 'part')}
    for band in range(bands):
        values = batch['sig'][alive, band * rows : (band + 1) * rows]
        for k in ('index', 'piece', 'size', 'hash'):
            out[k].append(batch[k][alive])
        out['band'].append(np.full(len(values), band, np.int64))
        out['bucket'].append(values)
        out['part'].append((_bucket_key(band, values) % np.uint64(parts)).astype(np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def _buckets(batch):
    """(order, starts, sizes): batch rows sorted by (band, bucket, index) and the runs of
    equal (band, bucket)."""
    keys = np.concatenate([batch['band'][:, None].astype(np.uint32), batch['bucket']], 1)
    keys = np.ascontiguousarray(keys)
    values = keys.view(np.dtype((np.void, keys.itemsize * keys.shape[1]))).ravel()
    group = np.unique(values, return_inverse=True)[1].ravel()
    order = np.lexsort((batch['index'], group))
    ordered = group[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return order, starts, np.diff(np.r_[starts, len(ordered)])


def bucket_members(batch):
    """The rows of buckets holding two or more documents, with bucket_size."""
    order, starts, sizes = _buckets(batch)
    take = np.concatenate([order[s : s + n] for s, n in zip(starts, sizes) if n > 1] or [[]])
    take = take.astype(np.int64)
    bucket_size = np.concatenate([np.full(n, n) for n in sizes if n > 1] or [[]]).astype(np.int64)
    return {**{k: v[take] for k, v in batch.items()}, 'bucket_size': bucket_size}


def candidate_shingles(batch, piece, options):
    """The member rows of one piece with their shingles (sorted unique uint32, as bytes)."""
    index, texts = _texts(piece, options.json_key)
    wanted = set(batch['index'].tolist())
    started, found = time.process_time(), {}
    for i, text in zip(index.tolist(), texts):
        if i in wanted:
            found[i] = fuzzy.shingles(text, options.shingle_words).tobytes()
    share = (time.process_time() - started) / max(len(batch['index']), 1)
    shingles = np.empty(len(batch['index']), object)
    shingles[:] = [found[i] for i in batch['index'].tolist()]
    return {**batch, 'shingles': shingles, 'fuzzy_s': np.full(len(shingles), share)}


_EDGE = ('a', 'b', 'jaccard', 'piece_a', 'piece_b', 'size_a', 'size_b', 'hash_a', 'hash_b')
_COUNTS = ('checked', 'largest', 'pairs')


def verified_edges(batch, threshold):
    """Edges (a < b, exact Jaccard >= threshold) of the buckets in the batch, and one row
    (a = -1) counting the pairs verified, the largest bucket and the pairs in buckets. Within a
    bucket, pairs in index order, and a pair already joined is not verified again
    (fuzzy.clusters' rule, per bucket)."""
    started = time.process_time()
    order, starts, sizes = _buckets(batch)
    edges, checked = [], 0
    counts = (0, int(sizes.max(initial=0)), int((sizes * (sizes - 1) // 2).sum()))
    for s, n in zip(starts, sizes):
        rows = order[s : s + n]
        shingle_sets = {int(batch['index'][r]): np.frombuffer(batch['shingles'][r], np.uint32)
                        for r in rows}  # fmt: skip
        at = {int(batch['index'][r]): r for r in rows}
        members = sorted(shingle_sets)
        pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1 :]]
        _, verified, joined = fuzzy.clusters(pairs, shingle_sets, threshold)
        checked += verified
        for (a, b), similarity in joined.items():
            ra, rb = at[a], at[b]
            edges.append((a, b, similarity, batch['piece'][ra], batch['piece'][rb],
                          batch['size'][ra], batch['size'][rb], batch['hash'][ra],
                          batch['hash'][rb]))  # fmt: skip
    edges = [e + (0, 0, 0) for e in edges] + [
        (-1, -1, 0.0, -1, -1, 0, 0, 0, 0, checked) + counts[1:]
    ]
    columns = list(zip(*edges))
    dtypes = (np.int64,) * 2 + (np.float64,) + (np.int64,) * 4 + (np.uint64,) * 2 + (np.int64,) * 3
    out = {k: np.array(c, d) for k, c, d in zip(_EDGE + _COUNTS, columns, dtypes)}
    out['fuzzy_s'] = np.full(len(edges), (time.process_time() - started) / len(edges))
    return out


def digest(values):
    """A short hex digest of JSON-able values: a work folder's inputs and options."""
    return hashlib.sha256(repr(values).encode()).hexdigest()[:16]
