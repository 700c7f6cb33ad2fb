"""The n-gram baselines against hand arithmetic on a two-word language."""

import math

import numpy as np
import pytest

from mtnlg_jax.eval import baselines


def test_bigram_of_an_alternating_language():
    # Train: "0 1 0 1 0 1" (N = 6, vocab 3): after 0 always 1, after 1 always 0.
    train = np.array([0, 1, 0, 1, 0, 1])
    uni = {0: (3 + 1) / (6 + 3), 1: (3 + 1) / (6 + 3), 2: (0 + 1) / (6 + 3)}
    assert baselines.unigram_probs(train, 3) == pytest.approx([uni[0], uni[1], uni[2]])

    evals = np.array([0, 1, 0, 2])  # targets 1 | 0, 0 | 1, 2 | 0
    expected = -np.mean(
        [
            math.log(0.7 * 1.0 + 0.3 * uni[1]),  # count(0 1) / count(0) = 3 / 3
            math.log(0.7 * 1.0 + 0.3 * uni[0]),  # count(1 0) / count(1) = 2 / 2 (last 1 ends)
            math.log(0.7 * 0.0 + 0.3 * uni[2]),  # 0 2 never seen
        ]
    )
    assert baselines.bigram_cross_entropy(train, evals, 3) == pytest.approx(expected)
    expected_uni = -np.mean([math.log(uni[1]), math.log(uni[0]), math.log(uni[2])])
    assert baselines.unigram_cross_entropy(train, evals, 3) == pytest.approx(expected_uni)


def test_unseen_context_falls_back_to_the_unigram():
    train = np.array([0, 1, 0, 1])
    evals = np.array([2, 0])  # context 2 never seen in training
    uni = baselines.unigram_probs(train, 3)
    assert baselines.bigram_cross_entropy(train, evals, 3) == pytest.approx(-math.log(uni[0]))


def test_bigram_beats_unigram_on_a_predictable_stream():
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 50, 40)
    stream = np.tile(pattern, 30)
    bigram = baselines.bigram_cross_entropy(stream[:800], stream[800:], 50)
    assert bigram < 0.6 * baselines.unigram_cross_entropy(stream[:800], stream[800:], 50)
