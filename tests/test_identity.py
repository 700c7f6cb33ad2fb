"""A run knows its tokenizer and its data: token files carry their tokenizer's identity, and
training, resuming, evaluation and generation refuse ids of another tokenizer (one of the
same size included), and a resume that changes the recipe or the data stream says so."""

import json
import shutil

import numpy as np
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.data import identity, loader
from mtnlg_jax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, token_dtype
from support import ROOT, SMALL_MODEL, launch_in_process, launch_module, run_launch, run_train

CORPUS = ROOT / 'tests/fixtures/curation'
VOCAB = 320
RUN = [*SMALL_MODEL, f'--config.model.vocab_size={VOCAB}', '--config.train.eval_every=0']


def preprocess(prefix, tokenizer, corpus='good.jsonl', train=False):
    args = ['--input', CORPUS / corpus, '--tokenizer-model', tokenizer, '--append-eod']
    if train:
        args += ['--train-tokenizer', '--vocab-size', VOCAB]
    result = run_launch('preprocess.py', *args, '--output-prefix', prefix)
    assert result.returncode == 0, result.stderr


def tokenized(prefix, model, corpus):
    """PREFIX.bin/.idx and its identity sidecar: `corpus` under the tokenizer `model`, written
    in this process with the calls launch/preprocess.py ends in (each document encoded with
    its eod, identity.finish), without the embedded Ray a subprocess starts (10 to 20 s)."""
    from mtnlg_jax.data import preprocess as preprocess_lib
    from mtnlg_jax.data import tokenizer as tokenizer_lib

    found = tokenizer_lib.load(str(model))
    writer = IndexedDatasetWriter(str(prefix), token_dtype(found.vocab_size))
    for text in preprocess_lib.documents([str(CORPUS / corpus)]):
        writer.add(np.asarray(found.encode_document(text)))
    identity.finish(writer, found)


@pytest.fixture(scope='module')
def corpora(tmp_path_factory):
    """Two tokenizers of the same size (320 pieces, trained on other text) and token files:
    a/text (tokenizer a), b/text (tokenizer b), c/text (other documents, tokenizer a). a is
    launch/preprocess.py's work end to end; b and c are written in this process."""
    root = tmp_path_factory.mktemp('corpora')
    preprocess(root / 'a/text', root / 'a/tokenizer.model', train=True)
    (root / 'b').mkdir()
    train = ['--input', str(CORPUS / 'planted.jsonl'), '--train-tokenizer', '--vocab-size']
    train += [str(VOCAB), '--tokenizer-model', str(root / 'b/tokenizer.model')]
    assert launch_module('preprocess').main(train) == 0  # training alone starts no Ray
    tokenized(root / 'b/text', root / 'b/tokenizer.model', 'planted.jsonl')
    tokenized(root / 'c/text', root / 'a/tokenizer.model', 'planted.jsonl')
    return root


def sources(prefix):
    return f'--config.data.sources=((1.0, {str(prefix)!r}),)'


def tokenizer(path):
    return f'--config.data.tokenizer={path}'


@pytest.fixture(scope='module')
def trained(corpora):
    """A workdir of 2 steps on a/text with tokenizer a."""
    workdir = corpora / 'run'
    result = run_train(
        workdir, *RUN, '--config.train.steps=2', tokenizer(corpora / 'a/tokenizer.model'),
        sources(corpora / 'a/text'),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def copy_of(workdir, tmp_path):
    """A workdir copied from another run (its config's paths still name that run's files)."""
    copy = tmp_path / 'copy'
    shutil.copytree(workdir, copy)
    return copy


@pytest.fixture
def refused(capsys, monkeypatch):
    """refused(tool, *args, needles=()): launch/TOOL.py's main in this process (a refusal
    comes before any compile: test_command_line_contract.py runs the command lines) ends with
    status 2 and one `error:` line, its last, holding each needle; returns it."""

    def run(tool, *args, needles=()):
        status, _, lines = launch_in_process(tool, capsys, monkeypatch, *args)
        errors = [line for line in lines if line.startswith('error: ')]
        assert status == 2 and len(errors) == 1 and lines[-1] == errors[0], lines[-20:]
        for needle in needles:
            assert needle in errors[0], errors[0]
        return errors[0]

    return run


def train(workdir, *overrides):
    """launch/train.py's arguments (configs/tiny.py) without the interpreter."""
    return ['--config', ROOT / 'configs/tiny.py', '--workdir', workdir, *overrides]


def sha(path):
    from mtnlg_jax.data import tokenizer as tokenizer_lib

    return tokenizer_lib.load(str(path)).identity[:12]


def test_preprocessing_writes_the_tokenizer_identity_beside_the_files(corpora):
    found = identity.read(str(corpora / 'a/text'))
    assert found['identity'] == identity.of_path(str(corpora / 'a/tokenizer.model'))['identity']
    assert found['vocab_size'] == VOCAB and found['kind'] == 'SentencePieceTokenizer'
    assert sha(corpora / 'a/tokenizer.model') != sha(corpora / 'b/tokenizer.model')
    assert len(IndexedDataset(str(corpora / 'a/text'))) == 30  # Megatron's reader: unchanged
    assert sorted(p.name for p in (corpora / 'a').iterdir()) == [
        'text.bin', 'text.identity.json', 'text.idx', 'tokenizer.model', 'tokenizer.vocab'
    ]  # fmt: skip


def test_training_refuses_data_of_another_tokenizer_of_the_same_size(corpora, tmp_path, refused):
    args = [*RUN, tokenizer(corpora / 'a/tokenizer.model'), sources(corpora / 'b/text')]
    needles = ('b/text.bin', sha(corpora / 'b/tokenizer.model'), sha(corpora / 'a/tokenizer.model'))
    refused('train', *train(tmp_path / 'run', *args), needles=needles)
    assert not (tmp_path / 'run').exists()


def test_a_blend_of_two_tokenizers_is_refused_without_a_tokenizer(corpora, tmp_path, refused):
    blend = f"--config.data.sources=((0.5, '{corpora}/a/text'), (0.5, '{corpora}/b/text'))"
    refused('train', *train(tmp_path / 'run', *RUN, blend), needles=('a/text.bin', 'b/text.bin'))


def config_of(corpora, data, order='layout_independent'):
    config = config_lib.defaults()
    config.model.update(dict(num_layers=2, hidden=64, heads=8, seq_len=32, vocab_size=VOCAB))
    config.train.update(dict(global_batch=8, micro_batch=8, steps=4))
    config.data.update(
        dict(sources=((1.0, str(data)),), tokenizer=str(corpora / 'a/tokenizer.model'), order=order)
    )
    return config_lib.resolve(config, 1)


@pytest.mark.parametrize('order', ['layout_independent', 'megatron'])
def test_both_data_orders_refuse_another_tokenizers_files(corpora, order):
    with pytest.raises(DataError, match='sha256 .* but data.tokenizer=.* is Sentence'):
        loader.open_datasets(config_of(corpora, corpora / 'b/text', order))
    assert set(loader.open_datasets(config_of(corpora, corpora / 'a/text', order))) >= {'train'}


def test_files_without_the_sidecar_are_read_with_one_warning(corpora, tmp_path, capsys):
    prefix = str(tmp_path / 'megatron_made')
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(50):
        writer.add(np.arange(97) % VOCAB)
    writer.finish()
    for _ in range(2):
        loader.open_datasets(config_of(corpora, prefix))
    warnings = [line for line in capsys.readouterr().err.splitlines() if 'megatron_made' in line]
    assert len(warnings) == 1 and warnings[0].startswith('warning: ')


def test_resuming_with_another_tokenizer_of_the_same_size_is_refused(
    corpora, trained, tmp_path, refused
):
    """The issue's case: the tokenizer changed on resume (a forgotten flag, or another file
    of the same size); the workdir is a copy of another run."""
    workdir = copy_of(trained, tmp_path)
    before = {p: p.read_bytes() for p in workdir.rglob('*') if p.is_file()}
    refused('train', *train(
        workdir, *RUN, '--config.train.steps=3', '--accept_changes',
        tokenizer(corpora / 'b/tokenizer.model'), sources(corpora / 'b/text'),
    ), needles=('cannot continue', sha(corpora / 'b/tokenizer.model')))  # fmt: skip
    assert {p: p.read_bytes() for p in workdir.rglob('*') if p.is_file()} == before


@pytest.mark.parametrize(
    'change,needle',
    [
        (['--config.data.split=900,90,10'], 'data.split'),
        (['--config.data.order=megatron'], 'data.order'),
        # a longer sequence is a new run (checkpoint.init_from: Llama 3's long-context stages)
        (['--config.model.seq_len=64'], 'model.seq_len: 32 -> 64'),
    ],
)
def test_a_data_stream_change_on_resume_needs_accept_changes(
    corpora, trained, refused, change, needle
):
    refused('train', *train(
        trained, *RUN, '--config.train.steps=3', *change,
        tokenizer(corpora / 'a/tokenizer.model'), sources(corpora / 'a/text'),
    ), needles=(needle, '--accept_changes'))  # fmt: skip


@pytest.mark.parametrize(
    'change,needle',
    [
        (['--config.model.num_layers=2'], 'model.num_layers: 4 -> 2'),
        (['--config.train.seed=7'], 'train.seed'),
    ],
)
def test_a_model_or_seed_change_on_resume_is_refused_even_when_accepted(
    corpora, trained, refused, change, needle
):
    refused('train', *train(
        trained, *RUN, '--config.train.steps=3', *change, '--accept_changes',
        tokenizer(corpora / 'a/tokenizer.model'), sources(corpora / 'a/text'),
    ), needles=(needle, 'cannot continue'))  # fmt: skip


def test_files_rewritten_under_the_same_prefix_change_the_data_stream(
    corpora, trained, tmp_path, refused
):
    data = tmp_path / 'text'  # the run's prefix, now holding other documents (same tokenizer)
    for suffix in ('.bin', '.idx', '.identity.json'):
        shutil.copy(corpora / f'c/text{suffix}', f'{data}{suffix}')
    workdir = copy_of(trained, tmp_path)
    recorded = json.loads((workdir / 'identity.json').read_text())
    recorded['data']['sources'][0]['prefix'] = str(data)
    (workdir / 'identity.json').write_text(json.dumps(recorded))
    inputs = json.loads((workdir / 'config.json').read_text())
    inputs['inputs']['data']['sources'] = [[1.0, str(data)]]
    (workdir / 'config.json').write_text(json.dumps(inputs))
    args = [*RUN, '--config.train.steps=3', tokenizer(corpora / 'a/tokenizer.model')]
    refused(
        'train', *train(workdir, *args, sources(data)), needles=('bin_bytes', '--accept_changes')
    )


def test_new_sources_continue_when_accepted_and_are_recorded(corpora, trained, tmp_path, refused):
    workdir = copy_of(trained, tmp_path)
    blend = f"--config.data.sources=((0.5, '{corpora}/a/text'), (0.5, '{corpora}/c/text'))"
    args = [*RUN, '--config.train.steps=3', tokenizer(corpora / 'a/tokenizer.model'), blend]
    refused('train', *train(workdir, *args), needles=('data.sources', '--accept_changes'))
    result = run_train(workdir, *args, '--accept_changes')
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'resumed      from step 2' in result.stdout
    recorded = json.loads((workdir / 'identity.json').read_text())
    assert len(recorded['data']['sources']) == 2
    assert recorded['changes'][0]['after_step'] == 2
    assert 'data.sources' in recorded['changes'][0]['changed'][0]


def test_evaluation_refuses_another_tokenizers_data_and_tokenizer(corpora, trained, refused):
    args = ['--workdir', trained, '--task', 'perplexity', '--split', 'valid']
    needles = ('b/text.bin', sha(corpora / 'b/tokenizer.model'), sha(corpora / 'a/tokenizer.model'))
    refused('evaluate', *args, '--data', corpora / 'b/text', needles=needles)
    other = ['--data', corpora / 'a/text', '--tokenizer', corpora / 'b/tokenizer.model']
    refused('evaluate', *args, *other, needles=('--tokenizer', sha(corpora / 'b/tokenizer.model')))


@pytest.mark.parametrize('tool', ['evaluate', 'generate'])
def test_a_tokenizer_replaced_since_training_is_refused(corpora, trained, tmp_path, refused, tool):
    """A copied workdir whose config names a tokenizer file rewritten since (same size)."""
    workdir = copy_of(trained, tmp_path)
    model = tmp_path / 'tokenizer.model'
    shutil.copy(corpora / 'a/tokenizer.model', model)
    saved = json.loads((workdir / 'config.json').read_text())
    for section in (saved, saved['inputs']):
        section['data']['tokenizer'] = str(model)
    (workdir / 'config.json').write_text(json.dumps(saved))
    shutil.copy(corpora / 'b/tokenizer.model', model)  # replaced in place
    if tool == 'evaluate':
        args = ['--task', 'lambada', '--data', CORPUS / 'eval.jsonl']
    else:
        args = ['--prompt', 'And', '--max_new_tokens', '2']
    refused(
        tool, '--workdir', workdir, *args, needles=(str(model), sha(corpora / 'a/tokenizer.model'))
    )
