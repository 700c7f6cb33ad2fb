"""Stage 2, fuzzy deduplication (MT-NLG's): MinHash + LSH, candidates verified, clusters.

    each document: word n-gram shingles (default 5 words) -> MinHash signature (datasketch,
        num_perm uint32, 'affine32' permutations)                            [workers]
    all signatures: LSH, b bands x r rows chosen for the threshold by datasketch's
        optimiser, weighted against false negatives (a missed pair is a kept duplicate;
        a false candidate only costs a verification); the banding itself in numpy, which
        bench/curate.py measured faster than datasketch's MinHashLSH        [main]
    candidate pairs (shared bucket in any band): exact Jaccard of their shingle sets,
        loaded in a second pass for candidates only                         [workers]
    verified pairs (Jaccard >= threshold) -> connected components; in each, the document
        first in exact.preference_order is kept, the others removed          [main]

Memory in the main process: num_perm x 4 bytes per document, the LSH tables, and the shingle
hashes (4 bytes per shingle) of candidate documents only. The result depends on the documents
alone: not on input order (the LSH buckets, the components and the preference are all order
free) nor on the worker count.
"""

import numpy as np
from datasketch import MinHash, MinHashLSH

from mtnlg_jax.data.curate.exact import preference_order
from mtnlg_jax.data.curate.text import ngram_hashes, word_hashes, words

# LSH band choice: false negatives weighted 0.95 against false positives 0.05 in datasketch's
# optimiser. At Jaccard 0.8 and 128 permutations this picks 16 bands x 8 rows: a pair at
# exactly the threshold becomes a candidate with probability 0.95, at 0.85 with 0.994.
LSH_WEIGHTS = (0.05, 0.95)


def _identity(value):  # shingles arrive already hashed (text.ngram_hashes)
    return value


def shingles(text, n):
    """Sorted unique uint32 hashes of the document's word n-grams (the whole document as one
    shingle when it has fewer than n words; none when it has no word)."""
    hashes = word_hashes(words(text))
    grams = ngram_hashes(hashes, min(n, len(hashes))) if len(hashes) else hashes
    return np.unique((grams ^ (grams >> np.uint64(32))).astype(np.uint32))


class Signer:
    """MinHash signatures with datasketch, the permutations made once per worker."""

    def __init__(self, num_perm=128, seed=1):
        self.base = MinHash(num_perm=num_perm, seed=seed, hashfunc=_identity, scheme='affine32')

    def __call__(self, shingle_hashes):
        sketch = self.base.copy()
        if len(shingle_hashes):
            sketch.update_batch(shingle_hashes)
        return sketch.hashvalues


def bands_and_rows(threshold, num_perm):
    """datasketch's choice of (bands, rows) for the threshold, weighted by LSH_WEIGHTS."""
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    return lsh.b, lsh.r


def _bucket_pairs(buckets):
    """Every pair (a, b), a < b, inside each bucket (an iterable of key collections)."""
    pairs = set()
    for members in buckets:
        members = sorted(members)
        for i, a in enumerate(members):
            pairs.update((a, b) for b in members[i + 1 :])
    return sorted(pairs)


def candidate_pairs(signatures, keys, threshold, num_perm):
    """Pairs (a, b), a < b, of `keys` whose signatures agree on all rows of some band; and
    (bands, rows).

    Written here rather than with datasketch's MinHashLSH (candidate_pairs_datasketch, the same
    pairs): an index that is built once and never queried is one stable sort per band in
    numpy, about 50 times faster than inserting sketches one by one (bench/curate.py).
    """
    bands, rows = bands_and_rows(threshold, num_perm)
    keys = np.asarray(keys)
    buckets = []
    for band in range(bands):
        rows_of_band = np.ascontiguousarray(signatures[:, band * rows : (band + 1) * rows])
        values = rows_of_band.view(np.dtype((np.void, rows_of_band.itemsize * rows))).ravel()
        order = np.argsort(values, kind='stable')
        ordered = values[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        sizes = np.diff(np.r_[starts, len(ordered)])
        buckets += [keys[order[s : s + n]].tolist() for s, n in zip(starts, sizes) if n > 1]
    return _bucket_pairs(buckets), (bands, rows)


def candidate_pairs_datasketch(signatures, keys, threshold, num_perm, seed=1):
    """candidate_pairs through datasketch's MinHashLSH: the reference the tests and the
    benchmark compare the numpy banding with."""
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    with lsh.insertion_session() as session:
        for key, signature in zip(keys, signatures):
            sketch = MinHash(seed=seed, hashvalues=signature, scheme='affine32')
            session.insert(int(key), sketch, check_duplication=False)
    buckets = (table.get(bucket) for table in lsh.hashtables for bucket in table.keys())
    return _bucket_pairs(buckets), (lsh.b, lsh.r)


def jaccard(a, b):
    """Exact Jaccard similarity of two sorted unique shingle arrays."""
    union = len(a) + len(b)
    if union == 0:
        return 1.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (union - common)


class _Components:
    """Union-find over document indices."""

    def __init__(self):
        self.parent = {}

    def find(self, x):
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while x != root:
            self.parent[x], x = root, self.parent.get(x, x)
        return root

    def union(self, a, b):
        root_a, root_b = self.find(a), self.find(b)
        self.parent.setdefault(root_b, root_b)
        self.parent[root_a] = root_b


def clusters(pairs, shingle_sets, threshold):
    """Connected components of the pairs whose exact Jaccard >= threshold.

    A pair already joined through verified pairs is not verified again: the components come
    out the same, and a big bucket of near copies costs about one check per document instead
    of one per pair. Returns ({root: members}, pairs verified, {(a, b): jaccard} of the
    edges that joined components).
    """
    components, edges, checked = _Components(), {}, 0
    for a, b in pairs:
        if components.find(a) == components.find(b):
            continue
        checked += 1
        similarity = jaccard(shingle_sets[a], shingle_sets[b])
        if similarity >= threshold:
            components.union(a, b)
            edges[(a, b)] = similarity
    return _groups(components), checked, edges


def _groups(components):
    groups = {}
    for index in sorted(components.parent):
        groups.setdefault(components.find(index), []).append(index)
    return [g for g in groups.values() if len(g) > 1]


def spanning_forest(a, b):
    """The edges (indices into a, b; a < b) that join components when the edges are taken in
    (a, b) order, in that order; a repeated pair counts once. Kruskal's forest with each
    edge's rank in that order as its weight (scipy: unique weights give one forest)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import minimum_spanning_tree

    if not len(a):
        return np.zeros(0, np.int64)
    order = np.lexsort((b, a))
    order = order[np.r_[True, (a[order][1:] != a[order][:-1]) | (b[order][1:] != b[order][:-1])]]
    nodes, ends = np.unique(np.r_[a[order], b[order]], return_inverse=True)
    rank = np.arange(1, len(order) + 1, dtype=np.float64)
    graph = coo_matrix((rank, (ends[: len(order)], ends[len(order) :])), (len(nodes),) * 2)
    return order[np.sort(minimum_spanning_tree(graph.tocsr()).tocoo().data).astype(np.int64) - 1]


class EdgeForest:
    """clusters() from verified edges that arrive in batches, wherever they were verified,
    taken in (a, b) order as clusters() takes its pairs. It keeps only the spanning forest of
    the edges seen so far: an edge left out closes a cycle of edges before it in that order,
    so it joins nothing however the other edges come. What it holds is bounded by the
    documents in clusters (24 bytes an edge of the forest), not by the pairs verified."""

    def __init__(self):
        self.a, self.b, self.similarity = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)

    def add(self, a, b, similarity):
        a, b = np.r_[self.a, a].astype(np.int64), np.r_[self.b, b].astype(np.int64)
        keep = spanning_forest(a, b)
        self.a, self.b, self.similarity = a[keep], b[keep], np.r_[self.similarity, similarity][keep]

    def components(self):
        """(the documents in clusters, sorted; each one's cluster label; the similarity of the
        first edge in (a, b) order that joined it)."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        k = len(self.a)
        nodes, ends = np.unique(np.r_[self.a, self.b], return_inverse=True)
        graph = coo_matrix((np.ones(k), (ends[:k], ends[k:])), (len(nodes),) * 2)
        labels = connected_components(graph, directed=False)[1] if k else np.zeros(0, np.int64)
        first = np.full(len(nodes), k, np.int64)
        np.minimum.at(first, ends[:k], np.arange(k))
        np.minimum.at(first, ends[k:], np.arange(k))
        return nodes, labels, self.similarity[first]


def kept_of_clusters(groups, sizes, content_hashes):
    """{removed index: kept index} for clusters of indices into sizes / content_hashes."""
    removed = {}
    for group in groups:
        group = np.asarray(group)
        best = group[preference_order(sizes[group], content_hashes[group])[0]]
        removed.update({int(i): int(best) for i in group if i != best})
    return removed
