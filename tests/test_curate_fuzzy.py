"""Exact and fuzzy deduplication (mtnlg_jax/data/curate): planted near-duplicates at known
true Jaccard similarity, measured here on plain Python sets of word 5-grams."""

import json
import random
import re

import numpy as np
import pytest

from mtnlg_jax.data.curate import fuzzy, pipeline

THRESHOLD, SHINGLE = 0.8, 5


def true_jaccard(a, b):
    def grams(text):
        words = re.findall(r'\w+', text.lower())
        return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}

    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


@pytest.fixture(scope='module')
def planted():
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


def run(tmp_path, docs, workers=1, name='out'):
    source = tmp_path / f'{name}.in.jsonl'
    source.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    options = pipeline.Options(stages=('exact', 'fuzzy'), threshold=THRESHOLD, workers=workers)
    report = pipeline.curate([str(source)], str(tmp_path / f'{name}.jsonl'), options)
    kept = [json.loads(line)['text'] for line in open(tmp_path / f'{name}.jsonl')]
    return kept, report


def test_recall_and_precision_against_exact_jaccard(tmp_path, planted):
    docs, pairs, exact = planted
    kept, report = run(tmp_path, docs)
    kept = set(kept)
    above = [(a, b) for a, b, j in pairs if j >= THRESHOLD]
    assert 30 <= len(above) <= 170  # both sides of the threshold are well represented
    recall = sum((a in kept) != (b in kept) for a, b in above) / len(above)
    # Removed documents whose pair is truly below the threshold are false positives.
    removed = [(a, b, j) for a, b, j in pairs if not (a in kept and b in kept)]
    precision = sum(j >= THRESHOLD for _, _, j in removed) / max(len(removed), 1)
    assert recall >= 0.95 and precision >= 0.95, (recall, precision)
    assert all(a in kept or b in kept for a, b, _ in pairs)  # never both removed
    assert all((a in kept) + (b in kept) == 1 for a, b in exact)  # exact: always one of two
    stages = {s['stage']: s for s in report['stages']}
    assert stages['exact']['documents_removed'] == len(exact)
    assert stages['fuzzy']['documents_out'] == len(kept)
    assert stages['fuzzy']['bands'] * stages['fuzzy']['rows'] <= 128


def test_kept_documents_do_not_depend_on_worker_count_or_order(tmp_path, planted):
    docs = planted[0]
    kept, _ = run(tmp_path, docs, name='one')
    shuffled = list(docs)
    random.Random(1).shuffle(shuffled)
    kept_shuffled, report = run(tmp_path, shuffled, workers=2, name='two')
    assert report['workers'] == 2
    assert sorted(kept) == sorted(kept_shuffled)
    assert kept_shuffled == [d for d in shuffled if d in set(kept_shuffled)]  # input order kept


def test_numpy_banding_finds_the_pairs_datasketch_finds(planted):
    docs = planted[0]
    signer = fuzzy.Signer()
    signatures = np.stack([signer(fuzzy.shingles(d, SHINGLE)) for d in docs])
    keys = np.arange(len(docs)) * 3 + 7  # keys need not be positions
    ours, shape = fuzzy.candidate_pairs(signatures, keys, THRESHOLD, 128)
    reference, reference_shape = fuzzy.candidate_pairs_datasketch(signatures, keys, THRESHOLD, 128)
    assert shape == reference_shape == (16, 8)
    assert len(ours) > 50 and ours == reference
