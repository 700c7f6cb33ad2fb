"""Stage 1, exact deduplication: documents equal after normalisation (NFKC, lowercase,
whitespace runs collapsed) are duplicates; one of each group is kept.

Workers compute a 128-bit fingerprint per document; the main process keeps only the
fingerprints (16 bytes a document, not the texts) and groups them with one sort at the end.
Which document of a group survives is `preferred`'s rule, shared with fuzzy deduplication, so
it depends on the documents alone, never on the input order or the worker count.
"""

import hashlib

import numpy as np

from mtnlg_jax.data.curate.text import exact_key


def fingerprint(text):
    """(2,) uint64: blake2b-128 of the normalised text."""
    digest = hashlib.blake2b(exact_key(text).encode(), digest_size=16).digest()
    return np.frombuffer(digest, np.uint64)


def content_hash(text):
    """uint64 of the raw text: the tie-break between documents of equal size."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), 'little')


def preference_order(sizes, content_hashes):
    """Indices sorted best first: the longest document (bytes), then the smallest content hash.
    The first of a duplicate group in this order is the one kept."""
    return np.lexsort((content_hashes, -np.asarray(sizes, np.int64)))


def duplicates(fingerprints, sizes, content_hashes):
    """Exact duplicate groups of `fingerprints` (N, 2) -> (removed bool mask (N,), kept index
    for each document (itself if kept))."""
    n = len(sizes)
    if n == 0:
        return np.zeros(0, bool), np.zeros(0, np.int64)
    rank = np.empty(n, np.int64)
    rank[preference_order(sizes, content_hashes)] = np.arange(n)
    order = np.lexsort((rank, fingerprints[:, 1], fingerprints[:, 0]))
    sorted_fp = fingerprints[order]
    starts = np.ones(n, bool)
    starts[1:] = np.any(sorted_fp[1:] != sorted_fp[:-1], axis=1)
    group_first = order[np.maximum.accumulate(np.where(starts, np.arange(n), 0))]
    kept = np.empty(n, np.int64)
    kept[order] = group_first
    return kept != np.arange(n), kept
