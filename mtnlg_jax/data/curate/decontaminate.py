"""Stage 4, downstream decontamination with GPT-3's rule (Brown et al. 2020, Appendix C).

Every word n-gram (n = 13) of the evaluation sets is a contaminant. In a training document,
each matching n-gram is cut out together with `margin` (200) characters on each side; the
overlapping cuts merge into one; the pieces left between cuts are kept as documents of their
own unless shorter than `min_piece` (200) characters; a document cut more than
`max_matches` (10) times is dropped whole.

    text  ....aaaaaaaaa[200 chars|13-gram match|200 chars]bbbbbbbbbbb[..cut..]cc....
    kept:  piece 'aaa..' (>= 200 chars)     piece 'bbb..' (>= 200)   'cc' (< 200: dropped)

Words are \\w+ runs of the lowercased text (punctuation and case do not hide a match); the
n-grams are compared as 64-bit hashes (text.ngram_hashes) against one sorted array of the
evaluation sets' n-grams, by binary search.
"""

import dataclasses
import json

import numpy as np

from mtnlg_jax.data.curate.text import ngram_hashes, word_hashes, words
from mtnlg_jax.data.preprocess import JSON_SUFFIXES, InputError, input_files


@dataclasses.dataclass(frozen=True)
class Rule:
    n: int = 13
    margin: int = 200
    min_piece: int = 200
    max_matches: int = 10


def _strings(value):
    """Every string inside a JSON value (an evaluation item's prompt, choices, answer...)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def evaluation_texts(paths):
    """Each evaluation item's text: every string field of each jsonl line (all fields of a
    multiple-choice item joined by newlines), or a whole plain-text file."""
    for path in input_files(paths):
        try:
            with open(path, encoding='utf-8') as f:
                if not path.endswith(JSON_SUFFIXES):
                    yield f.read()
                    continue
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield '\n'.join(_strings(json.loads(line)))
                        except ValueError:
                            raise InputError(f'--eval {path}:{number}: not JSON') from None
        except UnicodeDecodeError as e:
            reason = f'not UTF-8 text ({e.reason} at byte {e.start})'
            raise InputError(f'--eval {path}: {reason}') from None
        except OSError as e:
            raise InputError(f'--eval {path}: {e.strerror or e}') from None


def contaminants(texts, n=13):
    """Sorted unique uint64 hashes of every word n-gram of the evaluation texts."""
    found = [ngram_hashes(word_hashes(words(text, spans=True)[0]), n) for text in texts]
    return np.unique(np.concatenate(found)) if found else np.zeros(0, np.uint64)


def cut_regions(text, ngrams, rule=Rule()):
    """Merged (start, end) character ranges to cut: each match with its margins."""
    word_list, spans = words(text, spans=True)
    grams = ngram_hashes(word_hashes(word_list), rule.n)
    # A binary search per n-gram: np.isin would sort the evaluation set's n-grams again for
    # every document.
    found = np.minimum(np.searchsorted(ngrams, grams), len(ngrams) - 1)
    hits = np.flatnonzero(ngrams[found] == grams)
    regions = []
    for i in hits:
        start = max(int(spans[i, 0]) - rule.margin, 0)
        end = min(int(spans[i + rule.n - 1, 1]) + rule.margin, len(text))
        if regions and start <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], end)
        else:
            regions.append([start, end])
    return [tuple(r) for r in regions]


def decontaminate(text, ngrams, rule=Rule()):
    """(pieces kept, regions cut). Untouched: ([text], []); dropped whole: ([], regions)."""
    regions = cut_regions(text, ngrams, rule) if len(ngrams) else []
    if not regions:
        return [text], []
    if len(regions) > rule.max_matches:
        return [], regions
    bounds = [0] + [b for region in regions for b in region] + [len(text)]
    pieces = (text[bounds[i] : bounds[i + 1]].strip() for i in range(0, len(bounds), 2))
    return [p for p in pieces if len(p) >= rule.min_piece], regions
