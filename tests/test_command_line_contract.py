"""The command-line contract of every tool (docs/cli.md), each case a cheap subprocess that
compiles nothing: --help everywhere; bad input is one line `error: ...` naming the flag, key or
file, exit status 2 and nothing written; nothing to do is said, exit 0; a continued run
derives its values again from its inputs."""

import json
import os
import subprocess
import sys

import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.data.tokenizer import Tokenizer
from mtnlg_jax.run.rundir import RunDir
from support import ROOT, SMALL_MODEL, TRAIN_ENV, small_config

SCRIPTS = ('train.py', 'evaluate.py', 'generate.py', 'convert.py', 'preprocess.py')
SCRIPTS += ('export_corpus.py', 'plan.py', 'spawn.py', 'harness.py', 'curate.py')


def run(script, *args):
    """A tool as a user runs it; JAX_LOG_COMPILES makes any compile print a line, so 'one
    line on stderr' also means 'nothing compiled'."""
    return subprocess.run(
        [sys.executable, str(ROOT / 'launch' / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(TRAIN_ENV, JAX_LOG_COMPILES='1'),
        timeout=120,
    )


def snapshot(directory):
    """{relative path: bytes} of every file under `directory`."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, 'rb') as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


@pytest.mark.parametrize('script', SCRIPTS)
def test_every_tool_answers_help(script):
    result = run(script, '--help')
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('usage: ') and not result.stderr
    if script in ('train.py', 'convert.py', 'plan.py'):  # the config's keys with defaults
        assert 'config keys' in result.stdout and '  model.hidden=768: ' in result.stdout
        assert '  mesh.data=-1: ' in result.stdout


@pytest.fixture(scope='module')
def small_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp('tokenizer')
    return Tokenizer.train(['In the beginning was the word.'] * 20, str(directory / 't'), 300)


@pytest.fixture
def places(tmp_path):
    """A workdir holding one file (which must survive), a file, a corrupt HF model."""
    workdir = tmp_path / 'run'
    workdir.mkdir()
    (workdir / 'metrics.jsonl').write_text('{"step": 1}\n')
    (tmp_path / 'a_file').write_text('not a directory')
    hf = tmp_path / 'hf'
    hf.mkdir()
    gpt2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256)
    (hf / 'config.json').write_text(json.dumps(gpt2))
    (hf / 'model.safetensors').write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": 1}garbage')
    return tmp_path


TINY = ('--config', 'configs/tiny.py', '--workdir', '{run}')
CASES = [
    ('train.py', ('--config', 'configs/nope.py', '--workdir', '{run}'), 'configs/nope.py: no such'),
    (
        'train.py',
        ('--config', 'configs/workdir.py:{tmp}/missing', '--workdir', '{run}'),
        'missing/config.json not found',
    ),
    ('train.py', (*TINY, '--config.modle.hidden=3'), "no key 'modle'; did you mean --config.model"),
    ('train.py', (*TINY, '--config.model.hiden=3'), 'did you mean --config.model.hidden?'),
    ('train.py', (*TINY, '--config.model=3'), '--config.model: is a section'),
    ('train.py', (*TINY, '--config.train.eval_every=-5'), 'train.eval_every: must be'),
    ('train.py', (*TINY, '--config.train.steps'), '--config.train.steps: give a value'),
    (
        'train.py',
        (*TINY, '--config.train.xla_options=xla_nope=1'),
        "train.xla_options: XLA does not take them: No such compile option: 'xla_nope'",
    ),
    ('train.py', (*TINY, '--wrokdir', 'x'), 'unrecognized argument --wrokdir; did you mean'),
    ('train.py', (*TINY[:3], '{tmp}/a_file'), '--workdir {tmp}/a_file: exists and is not a dir'),
    (
        'train.py',
        (*TINY, *SMALL_MODEL, '--config.data.tokenizer={tmp}/none.model'),
        'data.tokenizer: {tmp}/none.model: no such file',
    ),
    (  # the small tokenizer has 300 pieces
        'train.py',
        (
            *(*TINY, *SMALL_MODEL),
            '--config.data.tokenizer={tokenizer}',
            '--config.model.vocab_size=32',
        ),
        "has 300 pieces, but the model's vocabulary (model.vocab_size) is 32",
    ),
    (
        'convert.py',
        ('--import_hf', '{tmp}/hf', '--workdir', '{run}'),
        'model.safetensors: not a safetensors file',
    ),
    (
        'convert.py',
        ('--import_hf', '{tmp}/hf', '--workdir', '{tmp}/a_file'),
        '--workdir {tmp}/a_file: exists and is not a directory',
    ),
    (
        'convert.py',
        ('--export_hf', '{tmp}/a_file', '--workdir', '{run}'),
        '--export_hf {tmp}/a_file: exists and is not a directory',
    ),
    ('convert.py', ('--export_hf', '{tmp}/out', '--workdir', '{run}'), 'config.json not found'),
]


@pytest.mark.parametrize('script,args,message', CASES)
def test_bad_input_is_one_line_exit_2_nothing_written_nothing_compiled(
    places, small_tokenizer, script, args, message
):
    fill = dict(tmp=places, run=places / 'run', tokenizer=small_tokenizer.model_path)
    before = snapshot(places)
    result = run(script, *(a.format(**fill) for a in args))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), lines
    assert message.format(**fill) in lines[0], lines
    assert not result.stdout
    assert snapshot(places) == before


def test_nothing_to_do_is_said_and_changes_nothing(tmp_path):
    workdir = tmp_path / 'run'
    (workdir / 'checkpoints' / '5').mkdir(parents=True)  # a run at step 5
    (workdir / 'config.json').write_text('{"model": {}}')
    before = snapshot(workdir)
    result = run('train.py', *TINY[:3], workdir, *SMALL_MODEL, '--config.train.steps=5')
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        f'nothing to do: {workdir} is at step 5 and train.steps is 5 '
        f'(raise --config.train.steps to train on)'
    )
    assert not result.stderr  # JAX_LOG_COMPILES: nothing compiled
    assert snapshot(workdir) == before


def test_a_continued_run_derives_again_from_its_inputs(tmp_path, monkeypatch):
    """configs/workdir.py gives back the inputs (paths absolute), never the derived values:
    decay_tokens follows the new train.steps, whatever directory the run continues from."""
    first = small_config()  # 10 steps of 16 x 32 tokens: decay over 5,120 tokens
    assert first.optimizer.decay_tokens == 5120
    assert os.path.isabs(first.inputs.data.tokenizer)
    assert all(os.path.isabs(prefix) for _, prefix in first.inputs.data.sources)
    RunDir(tmp_path / 'run').write_config(first.to_dict())
    monkeypatch.chdir(tmp_path)  # somewhere else
    again = config_lib.load(str(ROOT / 'configs/workdir.py'), str(tmp_path / 'run'))
    assert 'padded_vocab' not in again.model and again.optimizer.decay_tokens == 0
    again.train.steps = 20
    resolved = config_lib.resolve(again, 1)
    assert resolved.optimizer.decay_tokens == 10240 == resolved.derived.optimizer.decay_tokens
    assert resolved.data.tokenizer == first.data.tokenizer  # not re-read against this cwd


def test_hlo_diff_against_a_base_without_the_layout_is_one_line(tmp_path):
    """bench/hlo_diff.py --against a base saved before a layout existed: one `error:` line
    naming it, exit 2, before any compile (with the default layouts, those the base lacks
    are named and left out)."""
    (tmp_path / 'sequential.train.hlo').write_text('HloModule m\n')
    command = [sys.executable, str(ROOT / 'bench/hlo_diff.py'), '--against', str(tmp_path)]
    result = subprocess.run(
        [*command, '--layouts', 'sequential'], capture_output=True, text=True, cwd=ROOT,
        env=dict(TRAIN_ENV, JAX_LOG_COMPILES='1'), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == f'error: --against {tmp_path} has no sequential'
