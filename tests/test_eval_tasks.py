"""The evaluation tasks on hand-made cases with known answers, scored by a character bigram
model in numpy (so the task logic is checked apart from the GPT), and the perplexity
arithmetic of Megatron's WikiText-103 protocol."""

import math

import numpy as np
import pytest

from mtnlg_jax.eval import tasks

LIKELY = math.log(0.9)
UNLIKELY = math.log(0.1 / 127)


def encode(text):
    """Characters as tokens: every word has several sub-word tokens."""
    return [ord(c) for c in text]


def bigram_scorer(log_prob_table):
    """A scorer with the real one's signature from a (vocab, vocab) next-token table."""

    def score(rows, description=''):
        sums, all_argmax, counts = [], [], []
        for tokens, mask in rows:
            scores = log_prob_table[tokens[:-1], tokens[1:]]
            argmax = scores >= log_prob_table[tokens[:-1]].max(axis=1)
            sums.append(scores[mask].sum())
            all_argmax.append(bool(argmax[mask].all()))
            counts.append(mask.sum())
        return np.array(sums), np.array(all_argmax), np.array(counts)

    return score


def chain_model(chain):
    """Each character of `chain` is followed by the next one with probability 0.9."""
    table = np.full((128, 128), math.log(1 / 128))
    for a, b in zip(chain, chain[1:]):
        table[ord(a)] = UNLIKELY
        table[ord(a), ord(b)] = LIKELY
    return bigram_scorer(table)


def test_lambada_needs_every_token_of_the_last_word_to_be_the_argmax():
    score = chain_model('xyz abcd')
    passages = [
        'xyz abcd',  # every token of ' abcd' is the likeliest: correct
        'xyz abce',  # the last sub-word token is not: wrong, though the first three are right
        'q xyz abc',  # the context is everything before the last space: ' abc' is right
        'xyz xbcd',  # the first token of the last word is wrong
    ]
    summary, correct = tasks.lambada(score, encode, passages, seq_len=64)
    assert correct.tolist() == [True, False, True, False]
    assert summary == dict(passages=4, correct=2, accuracy=0.5)


def test_lambada_keeps_the_last_word_when_the_passage_is_longer_than_the_window():
    score = chain_model('xyz abcd')
    _, correct = tasks.lambada(score, encode, ['w' * 100 + ' xyz abcd'], seq_len=8)
    assert correct.tolist() == [True]


def test_split_last_word_keeps_the_leading_space():
    assert tasks.split_last_word('He said hello  \n') == ('He said', ' hello')
    with pytest.raises(ValueError):
        tasks.split_last_word('alone')


def test_multiple_choice_picks_the_likeliest_continuation_raw_and_per_byte():
    score = chain_model('xabcdefg')
    items = [
        dict(context='x', choices=['abcdefg', 'z'], answer=0),  # right both ways
        dict(context='x', choices=['z', 'abc'], answer=1),  # right both ways
        # raw: 'aq' (one unlikely token) beats 'abcdefq' (one unlikely + 5 more likely ones);
        # per byte the long one wins: only the normalised score gets it right.
        dict(context='x', choices=['aq', 'abcdefq'], answer=1),
    ]
    summary, picks = tasks.multiple_choice(score, encode, items, seq_len=64)
    assert picks.tolist() == [[0, 0], [1, 1], [0, 1]]
    assert summary['accuracy'] == pytest.approx(2 / 3)
    assert summary['accuracy_norm'] == 1.0
    assert summary['shots'] == 0


def test_few_shot_prompts_hold_solved_other_items_and_repeat_by_seed():
    items = [dict(context=f'q{i}:', choices=[f' a{i}', f' b{i}'], answer=i % 2) for i in range(5)]
    prefix = tasks.few_shot_prefix(items, 2, shots=3, seed=7)
    examples = prefix.split(tasks.SHOT_SEPARATOR)[:-1]
    assert len(examples) == 3 and len(set(examples)) == 3
    assert 'q2:' not in prefix
    for example in examples:
        i = int(example[1])
        assert example == items[i]['context'] + items[i]['choices'][items[i]['answer']]
    assert prefix == tasks.few_shot_prefix(items, 2, shots=3, seed=7)
    assert tasks.few_shot_prefix(items, 2, shots=0, seed=7) == ''


def test_one_shot_scoring_sees_the_solved_example_before_the_context():
    seen = []

    def score(rows, description=''):
        seen.extend(''.join(map(chr, tokens)) for tokens, _ in rows)
        return np.zeros(len(rows)), np.zeros(len(rows), bool), np.ones(len(rows))

    items = [
        dict(context='A?', choices=[' y', ' n'], answer=0),
        dict(context='B?', choices=[' y', ' n'], answer=1),
    ]
    tasks.multiple_choice(score, encode, items, seq_len=64, shots=1)
    # Item 0's one shot can only be item 1, solved, and the other way round.
    assert seen == ['B? n\n\nA? y', 'B? n\n\nA? n', 'A? y\n\nB? y', 'A? y\n\nB? n']


@pytest.mark.parametrize(
    'length,seq_len,overlap', [(2, 8, 0), (50, 8, 0), (50, 8, 5), (64, 16, 15), (17, 16, 4)]
)
def test_sliding_windows_score_every_target_once_with_the_overlap_as_context(
    length, seq_len, overlap
):
    tokens = np.arange(length)
    scored = []
    for i, (window, mask) in enumerate(tasks.sliding_windows(tokens, seq_len, overlap)):
        assert len(window) <= seq_len + 1
        targets = window[1:][mask]
        scored.extend(targets.tolist())
        if i > 0:  # the first scored target of a later window has `overlap` tokens before it
            assert np.flatnonzero(mask)[0] >= overlap
    assert scored == list(range(1, length))


def test_uniform_model_perplexity_is_the_vocabulary_size_and_words_normalise_as_megatron():
    vocab = 50
    score = bigram_scorer(np.full((vocab, vocab), -math.log(vocab)))
    tokens = np.random.default_rng(0).integers(0, vocab, 301)
    result = tasks.perplexity(score, tokens, seq_len=32, overlap=16, num_words=121)
    assert result['targets'] == 300
    assert result['token_perplexity'] == pytest.approx(vocab)
    # Megatron: val_loss = loss / (tokens - 1); ppl = exp(val_loss * (tokens - 1) / (words - 1))
    val_loss = result['loss']
    assert result['word_perplexity'] == pytest.approx(math.exp(val_loss * 300 / 120))
    assert result['word_perplexity'] == pytest.approx(vocab**2.5)


def test_word_count_splits_on_spaces_as_megatron():
    assert (
        tasks.count_words(' = Valkyria Chronicles III = \n Senjō no Valkyria 3 @-@ \n') == 11
    )  # the newline too


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / 'items.jsonl'
    path.write_text('{"text": "a b"}\n{"txt": "c d"}\n')
    with pytest.raises(tasks.TaskDataError, match=r'items.jsonl:2: field .text.'):
        tasks.read_jsonl(path, dict(text=str))
