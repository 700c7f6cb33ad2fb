"""Quality filtering (mtnlg_jax/data/curate/quality.py): the classifier separates held-out
good text from generated junk; Gopher's heuristics flag what they should, and the vectorised
repetition statistics equal a plain Python count of Gopher's definitions."""

import collections
import random

import pytest

from mtnlg_jax.data.corpus import bible_documents
from mtnlg_jax.data.curate import quality


def junk(rng):
    """Web-like junk: keyword spam, navigation boilerplate, random strings, number tables."""
    kind = rng.randrange(4)
    if kind == 0:
        words = 'cheap casino bonus free pills click win best deal now online'.split()
        return ' '.join(rng.choice(words) for _ in range(rng.randint(60, 300)))
    if kind == 1:
        items = ['Home', 'About', 'Contact', 'Login', 'Register', 'Privacy', 'Terms', 'FAQ', 'Cart']
        return '\n'.join(' | '.join(rng.sample(items, 5)) for _ in range(rng.randint(10, 60)))
    if kind == 2:
        return ' '.join(
            ''.join(rng.choices('qxzjkvw0123456789', k=rng.randint(3, 12)))
            for _ in range(rng.randint(50, 300))
        )
    return '\n'.join(' '.join(str(rng.randint(0, 99999)) for _ in range(8)) for _ in range(40))


def test_classifier_separates_held_out_good_text_from_junk():
    chapters = list(bible_documents())
    random.Random(0).shuffle(chapters)
    rng = random.Random(1)
    reference, raw_good, held_out = chapters[:300], chapters[300:450], chapters[450:650]
    raw = raw_good + [junk(rng) for _ in range(150)]
    classifier = quality.Classifier().fit(reference, raw)
    held_out_junk = [junk(random.Random(100 + i)) for i in range(200)]
    scores = classifier.score(held_out + held_out_junk)
    correct = (scores[:200] >= 0.5).sum() + (scores[200:] < 0.5).sum()
    assert correct / 400 >= 0.9, correct / 400


@pytest.mark.parametrize(
    'text, reason',
    [
        ('the cat sat on the mat with a hat', 'too_few_words'),
        (' '.join(['zebra quokka marmot'] * 40), 'stop_words'),
        (
            '\n'.join(f'- an item of the list with the words {i}th' for i in range(30)),
            'bullet_lines',
        ),
        ('\n'.join(['the same line of text with the words here'] * 30), 'duplicate_lines'),
        (' '.join(['#tag'] * 30 + ['the words of the text and more'] * 10), 'symbol_ratio'),
    ],
)
def test_heuristics_name_the_rule_broken(text, reason):
    assert quality.heuristic_failure(text) == reason


def test_heuristics_keep_ordinary_prose():
    chapter = next(c for c in bible_documents() if c.startswith('Ruth 1\n'))
    assert quality.heuristic_failure(chapter) is None


def brute_force_shares(tokens):
    lowered = [t.lower() for t in tokens]
    total = sum(map(len, tokens))
    shares = {}
    for n in (2, 3, 4):
        grams = collections.Counter(tuple(lowered[i : i + n]) for i in range(len(tokens) - n + 1))
        gram, count = max(grams.items(), key=lambda item: item[1])
        shares['top', n] = count * sum(map(len, gram)) / total if count > 1 else 0.0
    for n in range(5, 11):
        grams = collections.Counter(tuple(lowered[i : i + n]) for i in range(len(tokens) - n + 1))
        covered = set()
        for i in range(len(tokens) - n + 1):
            if grams[tuple(lowered[i : i + n])] > 1:
                covered.update(range(i, i + n))
        shares['duplicate', n] = sum(len(tokens[i]) for i in covered) / total
    return shares


def test_repetition_statistics_match_a_plain_count():
    rng = random.Random(3)
    for _ in range(20):
        size = rng.randint(5, 60)
        vocabulary = [''.join(rng.choices('abcdef', k=rng.randint(1, 6))) for _ in range(size)]
        tokens = rng.choices(vocabulary, k=rng.randint(20, 200))
        phrase = tokens[: rng.randint(3, 12)]
        tokens = tokens + phrase + tokens[20:40] + [p.upper() for p in phrase]
        expected = brute_force_shares(tokens)
        got = quality.repetition_shares(tokens)
        for key, value in expected.items():
            if key[0] == 'top' and abs(value - got[key]) > 1e-12:
                # ties between equally frequent n-grams may pick another of equal count
                assert got[key] > 0
            else:
                assert got[key] == pytest.approx(value), key
