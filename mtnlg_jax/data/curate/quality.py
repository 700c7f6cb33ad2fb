"""Stage 3, quality filtering: heuristic rules, then a classifier, as MT-NLG and GPT-3 did.

Heuristics (Gopher's rules, Rae et al. 2021, with its thresholds): length in words, mean word
length, symbol-to-word ratio, share of words with a letter, stop words present, bullet and
ellipsis lines, and repetition (duplicate lines, the most frequent 2-4-gram, characters inside
duplicated 5-10-grams). Words are whitespace-separated tokens, as Gopher counts them; the
n-gram statistics run in numpy over word hashes (text.ngram_hashes). A document fails on the
first rule it breaks, and the rule's name is the reason in the report.

Classifier (GPT-3's, Appendix A): logistic regression on hashed word 1-2-grams
(scikit-learn's HashingVectorizer, stateless, so workers need only the fitted weights),
trained on a reference set of good text (label 1) against a sample of the raw source (label
0); a document is kept when its score P(good) >= the threshold. The raw sample is the k
documents with the smallest content hashes: the same whatever the input order.
"""

import dataclasses
import heapq

import numpy as np

from mtnlg_jax.data.curate.exact import content_hash
from mtnlg_jax.data.curate.text import ngram_hashes, word_hashes

STOP_WORDS = frozenset({'the', 'be', 'to', 'of', 'and', 'that', 'have', 'with'})
BULLETS = ('•', '●', '○', '■', '□', '▪', '▫', '–', '-', '*')


@dataclasses.dataclass(frozen=True)
class Rules:
    """Gopher's thresholds; a document breaking any of them is removed."""

    min_words: int = 50
    max_words: int = 100_000
    mean_word_length: tuple = (3.0, 10.0)
    max_symbol_ratio: float = 0.1  # ('#' + '...') per word
    min_alphabetic_words: float = 0.8
    min_stop_words: int = 2
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    max_duplicate_lines: float = 0.3  # share of lines
    max_duplicate_line_chars: float = 0.2  # share of characters
    max_top_ngram_chars: tuple = ((2, 0.20), (3, 0.18), (4, 0.16))
    max_duplicate_ngram_chars: tuple = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    )


def _duplicate_share(items):
    """(share of items that repeat an earlier one, share of their characters)."""
    seen, repeats, repeat_chars, total_chars = set(), 0, 0, 0
    for item in items:
        total_chars += len(item)
        if item in seen:
            repeats, repeat_chars = repeats + 1, repeat_chars + len(item)
        seen.add(item)
    return repeats / max(len(items), 1), repeat_chars / max(total_chars, 1)


def repetition_shares(tokens, top_ns=(2, 3, 4), duplicate_ns=(5, 6, 7, 8, 9, 10)):
    """Gopher's repetition statistics over word characters (lowercased tokens compared):
    {('top', n): characters of the most frequent repeated n-gram x its count / all,
    ('duplicate', n): characters of words inside any n-gram that occurs more than once / all}.
    """
    hashes = word_hashes([t.lower() for t in tokens])
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    ends = np.concatenate([[0], np.cumsum(lengths)])
    total, shares = max(int(ends[-1]), 1), {}
    for n in top_ns:
        grams = ngram_hashes(hashes, n)
        shares['top', n] = 0.0
        if len(grams):
            _, first, counts = np.unique(grams, return_index=True, return_counts=True)
            top = np.argmax(counts)  # ties: np.unique's order, a function of the hashes alone
            if counts[top] > 1:
                start = first[top]
                shares['top', n] = counts[top] * int(ends[start + n] - ends[start]) / total
    for n in duplicate_ns:
        grams = ngram_hashes(hashes, n)
        shares['duplicate', n] = 0.0
        if len(grams):
            _, inverse, counts = np.unique(grams, return_inverse=True, return_counts=True)
            repeated = np.flatnonzero(counts[inverse] > 1)
            cover = np.zeros(len(tokens) + 1, np.int64)  # +1 where a repeated n-gram starts,
            np.add.at(cover, repeated, 1)  # -1 where it ends: words with a running sum > 0
            np.add.at(cover, repeated + n, -1)  # lie inside one
            shares['duplicate', n] = int(lengths[np.cumsum(cover[:-1]) > 0].sum()) / total
    return shares


def _repetition(tokens, rules):
    """The name of the first repetition rule broken, or None."""
    limits_of = {'top': rules.max_top_ngram_chars, 'duplicate': rules.max_duplicate_ngram_chars}
    shares = repetition_shares(tokens, *([n for n, _ in v] for v in limits_of.values()))
    for kind, limits in limits_of.items():
        for n, limit in limits:
            if shares[kind, n] > limit:
                return f'{kind}_{n}gram_chars'
    return None


def heuristic_failure(text, rules=Rules()):
    """The name of the first rule `text` breaks (e.g. 'too_few_words'), or None if it passes."""
    tokens = text.split()
    count = len(tokens)
    if count < rules.min_words:
        return 'too_few_words'
    if count > rules.max_words:
        return 'too_many_words'
    mean = sum(map(len, tokens)) / count
    if not rules.mean_word_length[0] <= mean <= rules.mean_word_length[1]:
        return 'mean_word_length'
    if (text.count('#') + text.count('...') + text.count('…')) / count > rules.max_symbol_ratio:
        return 'symbol_ratio'
    if sum(any(c.isalpha() for c in t) for t in tokens) / count < rules.min_alphabetic_words:
        return 'alphabetic_words'
    if len(STOP_WORDS.intersection(t.lower() for t in tokens)) < rules.min_stop_words:
        return 'stop_words'
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        if sum(line.startswith(BULLETS) for line in lines) / len(lines) > rules.max_bullet_lines:
            return 'bullet_lines'
        ellipsis = sum(line.endswith(('...', '…')) for line in lines)
        if ellipsis / len(lines) > rules.max_ellipsis_lines:
            return 'ellipsis_lines'
        line_share, char_share = _duplicate_share(lines)
        if line_share > rules.max_duplicate_lines:
            return 'duplicate_lines'
        if char_share > rules.max_duplicate_line_chars:
            return 'duplicate_line_chars'
    return _repetition(tokens, rules)


def sample_by_hash(texts, k):
    """The k texts with the smallest content hashes, in hash order (bounded memory)."""
    heap = []  # max-heap by hash, through negation
    for text in texts:
        item = (-content_hash(text), text)
        if len(heap) < k:
            heapq.heappush(heap, item)
        elif item[0] > heap[0][0]:
            heapq.heapreplace(heap, item)
    return [text for _, text in sorted(heap, reverse=True)]


class Classifier:
    """P(good text) from hashed word 1-2-grams and a logistic regression (scikit-learn)."""

    def __init__(self, n_features=2**18, seed=0):
        from sklearn.feature_extraction.text import HashingVectorizer
        from sklearn.linear_model import LogisticRegression

        self.vectorizer = HashingVectorizer(
            n_features=n_features,
            alternate_sign=False,
            ngram_range=(1, 2),
            token_pattern=r'(?u)\b\w+\b',
            dtype=np.float32,
        )
        self.model = LogisticRegression(max_iter=1000, class_weight='balanced', random_state=seed)

    def fit(self, good_texts, raw_texts):
        if not good_texts or not raw_texts:
            raise ValueError('the classifier needs both reference and raw documents')
        features = self.vectorizer.transform(list(good_texts) + list(raw_texts))
        labels = np.r_[np.ones(len(good_texts)), np.zeros(len(raw_texts))]
        self.model.fit(features, labels)
        return self

    def score(self, texts):
        """P(good) of each text, float64 (len(texts),)."""
        return self.model.predict_proba(self.vectorizer.transform(texts))[:, 1]
