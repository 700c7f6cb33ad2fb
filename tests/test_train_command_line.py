"""launch/train.py as a user runs it: bad input fails fast and cleanly; a run leaves
config.json, metrics.jsonl, tensorboard events and a loss-curve PNG."""

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from mtnlg_jax.data.loader import write_token_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL_MODEL = [
    '--config.model.num_layers=2',
    '--config.model.hidden=64',
    '--config.model.heads=8',
    '--config.model.seq_len=32',
    '--config.model.vocab_size=300',
    '--config.train.global_batch=16',
    '--config.train.micro_batch=2',
]


# The process tests start launch/train.py dozens of times with the same few small models: an
# XLA compilation cache shared by this session's runs lets every run after the first skip
# most of its compile time (about 5x faster on a 2-core CPU).
_COMPILATION_CACHE = tempfile.mkdtemp(prefix='mtnlg_jax_test_xla_cache_')
atexit.register(shutil.rmtree, _COMPILATION_CACHE, True)
TRAIN_ENV = dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=_COMPILATION_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
)


def train_args(workdir, *overrides, data=None):
    """The command line of launch/train.py with configs/tiny.py and `overrides`."""
    args = [
        sys.executable,
        str(ROOT / 'launch/train.py'),
        '--config',
        str(ROOT / 'configs/tiny.py'),
    ]
    args += ['--workdir', str(workdir), *overrides]
    if data is not None:
        args.append(f'--config.data.path={data}')
    return args


def run_train(workdir, *overrides, data=None):
    args = train_args(workdir, *overrides, data=data)
    return subprocess.run(
        args, capture_output=True, text=True, cwd=ROOT, env=TRAIN_ENV, timeout=300
    )


@pytest.fixture(scope='module')
def token_data(tmp_path_factory):
    """A small learnable dataset: a repeating pattern of token ids below 300."""
    path = tmp_path_factory.mktemp('data')
    pattern = np.random.default_rng(0).integers(0, 300, 97)
    write_token_file(str(path / 'train.npy'), np.tile(pattern, 200).astype(np.uint16))
    write_token_file(str(path / 'valid.npy'), np.tile(pattern, 20).astype(np.uint16))
    return path


@pytest.mark.parametrize(
    'overrides,key',
    [
        (['--config.mesh.data=3'], 'mesh'),
        (['--config.mesh.data=-1', '--config.mesh.tensor=-1'], 'mesh.'),
        (
            [
                '--config.model.hidden=384',
                '--config.model.heads=12',
                '--config.mesh.data=1',
                '--config.mesh.tensor=8',
            ],
            'model.heads',
        ),
        (['--config.model.ffn_hidden=1001'], 'model.ffn_hidden'),
        (['--config.train.global_batch=20'], 'train.global_batch'),
        (['--config.model.num_layers=3', '--config.pipeline.repeats=2'], 'model.num_layers'),
        (['--config.model.remat=sometimes'], 'model.remat'),
        (['--config.model.compute_dtype=int8'], 'model.compute_dtype'),
        (['--config.train.steps=0'], 'train.steps'),
        (['--config.model.no_such_key=1'], 'no_such_key'),
        (['--config.train.steps=many'], 'train.steps'),
        (['--config.data.path=/nonexistent/corpus'], '/nonexistent/corpus/train.npy'),
    ],
)
def test_bad_input_is_one_error_line_exit_2_and_the_workdir_untouched(tmp_path, overrides, key):
    workdir = tmp_path / 'run'
    workdir.mkdir()
    (workdir / 'metrics.jsonl').write_text('{"step": 1, "loss": 1.0}\n')
    result = run_train(workdir, *overrides)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith('error: ') and key in lines[-1], result.stderr
    assert sum(line.startswith('error: ') for line in lines) == 1
    assert sorted(os.listdir(workdir)) == ['metrics.jsonl']
    assert (workdir / 'metrics.jsonl').read_text() == '{"step": 1, "loss": 1.0}\n'


def test_token_ids_beyond_the_vocabulary_are_an_error(tmp_path, token_data):
    result = run_train(
        tmp_path / 'run', *SMALL_MODEL, '--config.model.vocab_size=200', data=token_data
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith('error: ')
    assert 'model.vocab_size=200' in result.stderr and 'train.npy' in result.stderr
    assert not (tmp_path / 'run').exists()


def test_missing_config_flag_is_an_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / 'launch/train.py'), '--workdir', str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (
        result.returncode == 2
        and result.stderr.startswith('error: ')
        and '--config' in result.stderr
    )


def test_a_short_run_writes_metrics_events_and_a_loss_curve(tmp_path, token_data):
    workdir = tmp_path / 'run'
    result = run_train(
        workdir,
        *SMALL_MODEL,
        '--config.train.steps=8',
        '--config.train.log_every=2',
        '--config.train.eval_every=4',
        '--config.train.eval_batches=2',
        data=token_data,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'mesh         data 4 x stage 1 x tensor 2' in result.stdout
    assert 'per device   parameters' in result.stdout

    config = json.loads((workdir / 'config.json').read_text())
    assert config['train']['micro_steps'] == 2 and config['model']['padded_vocab'] == 512

    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    train = [r for r in records if not r.get('eval')]
    evals = [r for r in records if r.get('eval')]
    assert [r['step'] for r in train] == [2, 4, 6, 8]
    assert [r['step'] for r in evals] == [4, 8]
    for key in (
        'loss',
        'lr',
        'grad_norm',
        'global_batch',
        'tokens_seen',
        'step_time_s',
        'tokens_per_s',
        'tflops_per_device',
        'mfu',
    ):
        assert key in train[0], key
    assert train[0]['mfu'] is None  # no known peak for a CPU
    assert train[-1]['tokens_seen'] == 8 * 16 * 32
    assert train[-1]['loss'] < train[0]['loss']
    assert evals[-1]['loss'] < evals[0]['loss']

    assert (workdir / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert list((workdir / 'tensorboard').glob('events.out.tfevents.*'))
