"""The evaluation tasks of the MT-NLG and Megatron-LM papers, as rows for a scorer.

Each task turns its data into scoring rows (scoring.py) and its scores into figures. `score`
is any function rows -> (log_prob_sum, all_argmax, count); `encode` any text -> token ids.

perplexity       a 1-D token array (a text file, a token file, an indexed dataset: any
                 source that yields one) cut into windows of seq_len + 1 tokens that overlap
                 by `overlap` tokens of context; every target is scored exactly once, with at
                 least `overlap` tokens before it (except in the first window). Word-normalised
                 perplexity follows Megatron's WikiText-103 protocol: the summed loss over the
                 model's tokens divided by the original word count minus one.
lambada          strict last-word accuracy: the passage without its last word is the context,
                 and a passage counts only if every sub-word token of the last word is the
                 argmax under teacher forcing.
multiple_choice  each choice scored by the log-likelihood of its tokens after the context;
                 accuracy of the most likely choice raw and normalised by the choice's length
                 in UTF-8 bytes (lm-evaluation-harness's acc and acc_bytes). k-shot prompts
                 prepend k solved examples drawn from the other items, reproducibly by seed.

A context and its continuation are tokenized as lm-evaluation-harness does (encode_pair), so
this module and the harness adapter (harness.py) score the same tokens: these tasks stay for
launch/evaluate.py (the papers' protocols with no dataset library, tested against the model
directly), and the harness runs on the same files through tasks/*.yaml with the same figures.
"""

import json
import math

import numpy as np

from mtnlg_jax.eval.scoring import continuation_row

SHOT_SEPARATOR = '\n\n'


class TaskDataError(ValueError):
    """An evaluation file that does not have the task's format; the message names the line."""


def read_jsonl(path, fields):
    """The records of a jsonl file, each checked to have `fields` (name -> type)."""
    records = []
    with open(path, encoding='utf-8') as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f'{path}:{number}: not JSON ({e.msg})') from e
            for name, kind in fields.items():
                if not isinstance(record.get(name), kind):
                    raise TaskDataError(
                        f'{path}:{number}: field {name!r} must be a {kind.__name__}'
                    )
            records.append(record)
    if not records:
        raise TaskDataError(f'{path}: no records')
    return records


# ---------------------------------------------------------------------------------- perplexity


def count_words(text):
    """Megatron's count of the original word-level tokens: the text split on single spaces
    (WikiText-103's test file is already tokenised into space-separated words)."""
    return len(text.strip().split(' '))


def sliding_windows(tokens, seq_len, overlap):
    """Rows covering every target of `tokens` once: windows of up to seq_len + 1 tokens, each
    starting seq_len - overlap after the previous one, masked to the targets not yet scored."""
    if not 0 <= overlap < seq_len:
        raise ValueError(f'overlap must be in [0, seq_len={seq_len}), got {overlap}')
    if len(tokens) < 2:
        raise ValueError(f'{len(tokens)} token(s): nothing to predict')
    rows, scored_until, start = [], 0, 0  # targets are positions 1 .. len - 1
    while scored_until < len(tokens) - 1:
        window = np.asarray(tokens[start : start + seq_len + 1], np.int32)
        target_positions = start + 1 + np.arange(len(window) - 1)
        rows.append((window, target_positions > scored_until))
        scored_until = int(target_positions[-1])
        start += seq_len - overlap
    return rows


def word_perplexity(loss_sum, num_words):
    """Megatron's WikiText-103 figure: exp(summed token loss / (original words - 1)), i.e.
    exp(mean token loss x token ratio) with the ratio (tokens - 1) / (words - 1)."""
    if num_words < 2:
        raise ValueError(f'word-normalised perplexity needs at least 2 words, got {num_words}')
    return math.exp(loss_sum / (num_words - 1))


def perplexity(score, tokens, seq_len, overlap, num_words=None):
    log_prob, _, count = score(sliding_windows(tokens, seq_len, overlap), 'perplexity')
    loss_sum, targets = -float(np.sum(log_prob)), int(np.sum(count))
    result = dict(
        tokens=len(tokens),
        targets=targets,
        seq_len=seq_len,
        overlap=overlap,
        loss=loss_sum / targets,
        token_perplexity=math.exp(loss_sum / targets),
    )
    if num_words:
        result.update(words=num_words, word_perplexity=word_perplexity(loss_sum, num_words))
    return result


# ------------------------------------------------------------------------------------- lambada


def split_last_word(text):
    """(context, ' last_word'): the last word keeps its leading space, as GPT-2 sees it."""
    text = text.strip()
    cut = text.rfind(' ')
    if cut <= 0:
        raise ValueError(f'a passage needs a context and a last word: {text[:60]!r}')
    return text[:cut], text[cut:]


def encode_pair(encode, context, continuation):
    """(context ids, continuation ids) as lm-evaluation-harness tokenizes them: the context's
    trailing spaces move to the continuation, the whole text is encoded at once and split
    after the context's own tokens (a token spanning the boundary counts as continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encode(context)
    return context_ids, encode(context + continuation)[len(context_ids) :]


def lambada(score, encode, passages, seq_len):
    """Strict last-word accuracy over passages (strings); per-passage outcomes alongside."""
    rows = []
    for text in passages:
        context, last_word = split_last_word(text)
        rows.append(continuation_row(*encode_pair(encode, context, last_word), seq_len))
    _, correct, _ = score(rows, 'lambada')
    summary = dict(
        passages=len(passages), correct=int(correct.sum()), accuracy=float(correct.mean())
    )
    return summary, correct


# ----------------------------------------------------------------------------- multiple choice


def few_shot_prefix(items, index, shots, seed):
    """`shots` solved examples other than items[index], the same for a given seed and index."""
    if shots == 0:
        return ''
    others = [i for i in range(len(items)) if i != index]
    if shots > len(others):
        raise ValueError(f'{shots} shots need {shots + 1} items, the file has {len(items)}')
    picked = np.random.default_rng([seed, index]).choice(others, shots, replace=False)
    return ''.join(
        items[i]['context'] + items[i]['choices'][items[i]['answer']] + SHOT_SEPARATOR
        for i in picked
    )


def check_choice_items(items):
    for number, item in enumerate(items, 1):
        choices = item['choices']
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise TaskDataError(f'item {number}: choices must be two or more non-empty strings')
        if not 0 <= item['answer'] < len(choices):
            raise TaskDataError(f'item {number}: answer {item["answer"]} is not a choice index')


def multiple_choice(score, encode, items, seq_len, shots=0, seed=0):
    """Accuracy of items {context, choices, answer}: the choice of highest log-likelihood, raw
    and per UTF-8 byte. Returns the summary and each item's (raw, normalised) picks."""
    check_choice_items(items)
    rows, owners = [], []
    for index, item in enumerate(items):
        context = few_shot_prefix(items, index, shots, seed) + item['context']
        for choice in item['choices']:
            rows.append(continuation_row(*encode_pair(encode, context, choice), seq_len))
            owners.append(index)
    log_prob, _, _ = score(rows, f'multiple choice ({shots}-shot)')
    owners = np.asarray(owners)
    picks, picks_norm = [], []
    for index, item in enumerate(items):
        item_log_prob = log_prob[owners == index]
        length = np.array([len(c.encode('utf-8')) for c in item['choices']])
        picks.append(int(np.argmax(item_log_prob)))
        picks_norm.append(int(np.argmax(item_log_prob / length)))
    answers = np.array([item['answer'] for item in items])
    summary = dict(
        items=len(items),
        shots=shots,
        accuracy=float(np.mean(np.array(picks) == answers)),
        accuracy_norm=float(np.mean(np.array(picks_norm) == answers)),
    )
    return summary, np.stack([picks, picks_norm], axis=1)
