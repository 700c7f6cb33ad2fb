"""Count-based language models: the floor a trained GPT must clear to have learned anything.

Both are fitted on one token stream (a training split) and scored on another (a validation
split), predicting each token from the one before it, the targets a perplexity evaluation
scores (every token but the first):

    unigram   p(b)     = (count(b) + 1) / (N + V)                    add-one: no zero on an
                                                                     unseen token
    bigram    p(b | a) = 0.7 count(a b) / count(a) + 0.3 p_uni(b)    interpolated (Jelinek-
                                                                     Mercer); p_uni(b) when
                                                                     a was never seen

Cross-entropy in nats per token, as the model's `loss`. Written with numpy alone (no library
fits n-gram counts over token ids this small in fewer lines); a bigram table is a sparse count
of pair ids a * V + b.
"""

import numpy as np

BIGRAM_WEIGHT = 0.7


def unigram_probs(train_tokens, vocab_size):
    counts = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab_size)
    return (counts + 1.0) / (counts.sum() + vocab_size)


def unigram_cross_entropy(train_tokens, eval_tokens, vocab_size):
    """Nats per target token of eval_tokens[1:] under the add-one unigram model."""
    probs = unigram_probs(train_tokens, vocab_size)
    return float(-np.log(probs[np.asarray(eval_tokens[1:], np.int64)]).mean())


def bigram_cross_entropy(train_tokens, eval_tokens, vocab_size, weight=BIGRAM_WEIGHT):
    """Nats per target token of eval_tokens[1:] given the token before each, under the
    interpolated bigram model above."""
    train = np.asarray(train_tokens, np.int64)
    evals = np.asarray(eval_tokens, np.int64)
    uni = unigram_probs(train, vocab_size)
    pair_ids, pair_counts = np.unique(train[:-1] * vocab_size + train[1:], return_counts=True)
    context_counts = np.bincount(train[:-1], minlength=vocab_size)

    prev, nxt = evals[:-1], evals[1:]
    wanted = prev * vocab_size + nxt
    where = np.clip(np.searchsorted(pair_ids, wanted), 0, len(pair_ids) - 1)
    pair = np.where(pair_ids[where] == wanted, pair_counts[where], 0)
    seen = context_counts[prev] > 0
    bigram = np.where(seen, pair / np.maximum(context_counts[prev], 1), 0.0)
    probs = np.where(seen, weight * bigram + (1 - weight) * uni[nxt], uni[nxt])
    return float(-np.log(probs).mean())
