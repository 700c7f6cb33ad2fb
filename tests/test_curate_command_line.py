"""launch/curate.py: one-line errors (exit 2, an existing output left as it was) for bad input
found before Ray starts (the runs on Ray, and the input errors its scan finds: the golden
files, a bad line, no documents, in test_ray_curation.py)."""

import json
import pathlib
import runpy

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]


def curate(*args):
    return runpy.run_path(str(ROOT / 'launch/curate.py'))['main']([str(a) for a in args])


def write_jsonl(path, texts):
    path.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts))
    return path


def one_document(folder):
    return write_jsonl(folder / 'ok.jsonl', ['text'])


@pytest.mark.parametrize(
    'make, flags, message',
    [
        (lambda d: d / 'missing.jsonl', (), 'missing.jsonl: no such file'),
        (one_document, ('--threshold', '0'), '--threshold must be in (0, 1]'),
        (one_document, ('--threshold', '1.5'), '--threshold must be in (0, 1]'),
        (
            one_document,
            ('--classifier_threshold', '-1'),
            '--classifier_threshold must be in (0, 1]',
        ),
        (one_document, ('--stages', 'decontaminate'), 'needs --eval'),
        (one_document, ('--stall_timeout_s', '-1'), '--stall_timeout_s must be >= 0'),
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
