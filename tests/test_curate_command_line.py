"""launch/curate.py: all four stages end to end with their JSON report, and one-line errors
(exit 2, an existing output left as it was) for bad input."""

import json
import pathlib
import random
import runpy

import pytest

from mtnlg_jax.data.corpus import bible_documents
from mtnlg_jax.data.curate.quality import heuristic_failure
from test_curate_quality import junk

ROOT = pathlib.Path(__file__).resolve().parents[1]


def curate(*args):
    return runpy.run_path(str(ROOT / 'launch/curate.py'))['main']([str(a) for a in args])


def write_jsonl(path, texts):
    path.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts))
    return path


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A raw source of Bible chapters and generated junk, with an exact and a near copy of a
    chapter, and a 13-gram of the evaluation set in one; the reference set (other chapters of
    the same books) and the evaluation set."""
    root = tmp_path_factory.mktemp('curate')
    chapters = [c for c in bible_documents() if len(c) > 2500 and heuristic_failure(c) is None][:80]
    rng = random.Random(0)
    generated = [junk(rng) for _ in range(30)]
    docs = chapters[0:80:2] + generated
    docs.append(chapters[0].upper())  # exact duplicate after normalisation
    near = chapters[2].split(' ')
    near[len(near) // 2] = 'CHANGED'
    docs.append(' '.join(near))  # near duplicate
    item = ' '.join(chapters[4].split()[40:60])
    eval_set = write_jsonl(root / 'eval.jsonl', [item])
    good = write_jsonl(root / 'good.jsonl', chapters[1:80:2])
    return write_jsonl(root / 'raw.jsonl', docs), good, eval_set, generated


def test_all_stages_and_their_report(tmp_path, corpus, capsys):
    raw, good, eval_set, generated = corpus
    output = tmp_path / 'out' / 'curated.jsonl'
    flags = ('--quality_reference', good, '--eval', eval_set, '--min_words', 10)
    assert curate('--input', raw, '--output', output, *flags) == 0
    printed = capsys.readouterr().out
    assert 'decontaminate' in printed and 'report:' in printed
    report = json.loads((tmp_path / 'out' / 'curated.report.json').read_text())
    stages = {s['stage']: s for s in report['stages']}
    assert list(stages) == ['exact', 'fuzzy', 'quality', 'decontaminate']
    assert stages['exact']['documents_removed'] == 1 and stages['fuzzy']['documents_removed'] == 1
    assert stages['quality']['documents_removed'] >= len(generated)
    assert stages['decontaminate']['reasons'] == {'cut': 1}
    for before, after in zip(report['stages'], report['stages'][1:]):
        assert before['documents_out'] == after['documents_in']
        assert before['bytes_out'] == after['bytes_in']
    lines = [json.loads(line)['text'] for line in output.read_text().splitlines()]
    assert not set(lines) & set(generated)
    # 38 distinct chapters: the classifier, whose negatives are this raw sample itself, may
    # score a few good ones just under 0.5
    assert len(lines) >= 30
    assert len(lines) == report['documents_out'] == stages['decontaminate']['pieces_out']
    assert all(s['examples'] for s in report['stages'])


def one_document(folder):
    return write_jsonl(folder / 'ok.jsonl', ['text'])


@pytest.mark.parametrize(
    'make, flags, message',
    [
        (lambda d: write_jsonl(d / 'empty.jsonl', []), (), 'no documents'),
        (lambda d: d / 'missing.jsonl', (), 'missing.jsonl: no such file'),
        (
            lambda d: (
                (d / 'bad.jsonl').write_bytes(b'{"text": "a"}\nnot json\n') and d / 'bad.jsonl'
            ),
            (),
            'bad.jsonl:2: not a JSON object',
        ),
        (
            lambda d: (d / 'latin1.txt').write_bytes(b'caf\xe9') and d / 'latin1.txt',
            (),
            'not UTF-8',
        ),
        (one_document, ('--threshold', '0'), '--threshold must be in (0, 1]'),
        (one_document, ('--threshold', '1.5'), '--threshold must be in (0, 1]'),
        (
            one_document,
            ('--classifier_threshold', '-1'),
            '--classifier_threshold must be in (0, 1]',
        ),
        (one_document, ('--stages', 'decontaminate'), 'needs --eval'),
    ],
)
def test_bad_input_is_one_line_and_keeps_the_old_output(tmp_path, capsys, make, flags, message):
    source = make(tmp_path)
    output = tmp_path / 'curated.jsonl'
    output.write_text('earlier output\n')
    assert curate('--input', source, '--output', output, *flags) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: ') and message in err, err
    assert output.read_text() == 'earlier output\n'
    assert not (tmp_path / 'curated.jsonl.tmp').exists()
