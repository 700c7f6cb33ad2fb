"""Decontamination with GPT-3's rule (mtnlg_jax/data/curate/decontaminate.py): a 13-gram
match is cut with 200 characters each side, pieces under 200 characters dropped, a document
cut more than 10 times dropped, and a 12-gram is no match."""

import random

from mtnlg_jax.data.curate.decontaminate import Rule, contaminants, decontaminate

RULE = Rule()
ITEM = (
    'Alas poor Yorick I knew him Horatio a fellow of infinite jest of most excellent fancy '
    'he hath borne me on his back a thousand times'
)
EVAL = contaminants([ITEM], RULE.n)


def filler(seed, characters):
    rng = random.Random(seed)
    words = []
    while sum(map(len, words)) + len(words) < characters:
        words.append(''.join(rng.choices('klmnopqrstuvw', k=rng.randint(2, 8))))
    return ' '.join(words)


def test_a_match_is_cut_with_200_characters_each_side():
    before, after = filler(0, 1000), filler(1, 1000)
    # 13 words of the item, in another case and punctuation
    match = 'I KNEW him, Horatio: a fellow of infinite jest, of most excellent fancy; he'
    text = f'{before} {match} {after}'
    start = text.index(match)
    pieces, regions = decontaminate(text, EVAL)
    assert regions == [(start - 200, start + len(match) + 200)]
    assert pieces == [text[: start - 200].strip(), text[start + len(match) + 200 :].strip()]


def test_short_pieces_are_dropped_and_a_12_gram_is_not_a_match():
    match = ' '.join(ITEM.split()[:13])
    text = f'{filler(2, 150)} {match} {filler(3, 600)}'
    pieces, regions = decontaminate(text, EVAL)
    assert len(regions) == 1 and pieces == [text[regions[0][1] :].strip()]  # the head: < 200
    twelve = ' '.join(ITEM.split()[1:13])
    clean = f'{filler(2, 500)} {twelve} {filler(3, 500)}'
    assert decontaminate(clean, EVAL) == ([clean], [])


def test_more_than_10_matches_drop_the_document():
    match = ' '.join(ITEM.split()[5:18])

    def document(matches):
        parts = [f'{filler(10 + i, 700)} {match}' for i in range(matches)]
        return ' '.join(parts + [filler(9, 700)])

    pieces, regions = decontaminate(document(10), EVAL)
    assert len(regions) == 10 and len(pieces) == 11
    pieces, regions = decontaminate(document(11), EVAL)
    assert len(regions) == 11 and pieces == []
