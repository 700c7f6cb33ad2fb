"""Every tool that writes checks each output path before it works: a folder it may not write
is one error line naming the flag, exit 2, before anything is compiled or computed, and
nothing is written; a failure at the end (a full disk) is one error line and leaves no
half-written file."""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from mtnlg_jax.run import cli
from mtnlg_jax.run.rundir import RunDir
from support import ROOT, launch_module, small_config

# Root writes anywhere unless CAP_DAC_OVERRIDE is dropped; the tools run without it here.
AS_USER = ['setpriv', '--bounding-set=-dac_override'] if os.geteuid() == 0 else []
needs_setpriv = pytest.mark.skipif(
    bool(AS_USER) and shutil.which('setpriv') is None, reason='root without setpriv'
)


def run_tool(script, *args):
    return subprocess.run(
        [*AS_USER, sys.executable, str(ROOT / 'launch' / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, JAX_LOG_COMPILES='1'),
    )


@pytest.fixture
def places(tmp_path):
    """A read-only folder, and a workdir of a small run (config.json and a checkpoint folder:
    the tools fail on their outputs before they would read it)."""
    workdir = tmp_path / 'run'
    RunDir(workdir).write_config(small_config().to_dict())
    (workdir / 'checkpoints' / '2').mkdir(parents=True)
    (tmp_path / 'text.jsonl').write_text('{"text": "In the beginning"}\n')
    locked = tmp_path / 'locked'
    locked.mkdir()
    yield dict(root=tmp_path, workdir=workdir, locked=locked)
    for path in (locked, workdir):
        os.chmod(path, 0o755)


def contents(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob('*'))


CASES = {  # tool: (arguments, the flag its error names); {locked}, {workdir}, {root}
    'evaluate --output': (
        'evaluate.py',
        ['--workdir', '{workdir}', '--task', 'lambada', '--data', '{root}/text.jsonl',
         '--output', '{locked}/out.json'],
        '--output',
    ),
    'evaluate into a read-only workdir': (
        'evaluate.py',
        ['--workdir', '{workdir}', '--task', 'lambada', '--data', '{root}/text.jsonl'],
        '--workdir',
    ),
    'plan --json': (
        'plan.py',
        ['--config', 'configs/tiny.py', '--json', '{locked}/plan.json'],
        '--json',
    ),
    'preprocess --output-prefix': (
        'preprocess.py',
        ['--input', '{root}/text.jsonl', '--tokenizer-model', 'tests/fixtures/curation/'
         'planted.tokenizer.model', '--output-prefix', '{locked}/new/text'],
        '--output-prefix',
    ),
    'preprocess --tokenizer-model': (
        'preprocess.py',
        ['--input', '{root}/text.jsonl', '--train-tokenizer', '--vocab-size', '300',
         '--tokenizer-model', '{locked}/tok.model'],
        '--tokenizer-model',
    ),
    'generate --output': (
        'generate.py',
        ['--workdir', '{workdir}', '--prompt', 'x', '--output', '{locked}/out.json'],
        '--output',
    ),
    'harness --output_path': (
        'harness.py',
        ['--workdir', '{workdir}', '--tasks', 'x', '--output_path', '{locked}/results'],
        '--output_path',
    ),
    'curate --output': (
        'curate.py',
        ['--input', '{root}/text.jsonl', '--output', '{locked}/curated.jsonl'],
        '--output',
    ),
    'export_corpus --out': ('export_corpus.py', ['--out', '{locked}/corpus'], '--out'),
    'convert --export_hf': (
        'convert.py',
        ['--workdir', '{workdir}', '--export_hf', '{locked}/hf'],
        '--export_hf',
    ),
    'train --workdir': (
        'train.py',
        ['--config', 'configs/tiny.py', '--workdir', '{locked}/run'],
        '--workdir',
    ),
}  # fmt: skip


@needs_setpriv
@pytest.mark.parametrize('case', CASES)
def test_a_read_only_output_is_one_error_line_before_any_work(places, case):
    script, args, flag = CASES[case]
    args = [arg.format(**places) for arg in args]
    locked = places['workdir'] if 'read-only workdir' in case else places['locked']
    os.chmod(locked, 0o555)
    before = contents(places['root'])
    result = run_tool(script, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f'error: {flag} '), lines
    assert 'Compiling' not in result.stderr + result.stdout  # JAX_LOG_COMPILES: nothing ran
    assert contents(places['root']) == before


def test_a_full_disk_at_the_end_is_one_error_line_and_no_half_written_file(
    tmp_path, monkeypatch, capsys
):
    path = tmp_path / 'result.json'
    path.write_text('{"old": 1}')

    def full(*_, **__):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json, 'dump', full)
    with pytest.raises(SystemExit) as exit_:
        cli.write_json(str(path), {'new': 2}, '--output')
    assert exit_.value.code == 1  # a run gone wrong at its end, not bad input
    assert capsys.readouterr().err.strip() == (
        f'error: --output {path}: not written (No space left on device)'
    )
    assert os.listdir(tmp_path) == ['result.json'] and path.read_text() == '{"old": 1}'


def test_output_problems_name_what_is_wrong(tmp_path):
    (tmp_path / 'file').write_text('')
    assert cli.output_problem(tmp_path / 'new' / 'deeper' / 'out.json') is None
    assert cli.output_problem(tmp_path) == 'is a folder; give a file name'
    assert cli.output_problem(tmp_path / 'file' / 'out.json').endswith('file is not a folder')
    assert cli.output_problem(tmp_path / 'file', directory=True) == 'exists and is not a folder'


def test_a_partial_evaluation_never_overwrites_the_full_one():
    evaluate = launch_module('evaluate')
    common = ['--workdir', 'w', '--data', 'data/mine/text', '--split', 'valid']

    def name(*extra, task='perplexity'):
        return evaluate.result_name(evaluate.parse_args([*common, '--task', task, *extra]), 7)

    assert name() == 'perplexity_text_valid_step7'
    assert name('--max_tokens', '1000') == 'perplexity_text_valid_tokens1000_step7'
    assert name('--limit', '5', task='lambada') == 'lambada_text_valid_limit5_step7'
