"""Exact and fuzzy deduplication (mtnlg_jax/data/curate): planted near-duplicates at known
true Jaccard similarity, measured here on plain Python sets of word 5-grams (the runs of the
whole pipeline on them are in test_ray_curation.py)."""

import random
import re

import numpy as np
import pytest

from mtnlg_jax.data.curate import fuzzy

THRESHOLD, SHINGLE = 0.8, 5


def true_jaccard(a, b):
    def grams(text):
        words = re.findall(r'\w+', text.lower())
        return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}

    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


@pytest.fixture(scope='module')
def planted():
    return planted_documents()


def planted_documents():
    """200 originals, each with one variant (1 word to 12 % of its words replaced: Jaccard
    about 0.45 to 1), and 10 exact duplicates (case and spacing changed). Returns (documents,
    pairs as (original, variant, true Jaccard), exact duplicate pairs)."""
    rng = random.Random(0)
    letters = 'abcdefghijklmnopqrstuvwxyz'
    vocabulary = [''.join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(20000)]
    docs, pairs, exact = [], [], []
    for _ in range(200):
        words = rng.choices(vocabulary, k=rng.randint(150, 400))
        variant = list(words)
        for i in rng.sample(range(len(words)), max(1, int(len(words) * rng.uniform(0, 0.12)))):
            variant[i] = rng.choice(vocabulary)
        a, b = ' '.join(words), ' '.join(variant)
        docs += [a, b]
        pairs.append((a, b, true_jaccard(a, b)))
    for i in range(10):
        words = rng.choices(vocabulary, k=100)
        a = ' '.join(words)
        docs += [a, '  ' + ' '.join(words).upper() + '\n']
        exact.append((a, docs[-1]))
    return docs, pairs, exact


def test_numpy_banding_finds_the_pairs_datasketch_finds(planted):
    docs = planted[0]
    signer = fuzzy.Signer()
    signatures = np.stack([signer(fuzzy.shingles(d, SHINGLE)) for d in docs])
    keys = np.arange(len(docs)) * 3 + 7  # keys need not be positions
    ours, shape = fuzzy.candidate_pairs(signatures, keys, THRESHOLD, 128)
    reference, reference_shape = fuzzy.candidate_pairs_datasketch(signatures, keys, THRESHOLD, 128)
    assert shape == reference_shape == (16, 8)
    assert len(ours) > 50 and ours == reference
