"""launch/preprocess.py: raw text (jsonl, plain files, folders) to a .bin/.idx pair, with a
tokenizer it trains or is given, one or several workers, and one-line errors for bad input."""

import json
import os
import pathlib

import numpy as np
import pytest

from mtnlg_jax.data import identity, ray_engine
from mtnlg_jax.data.indexed import IndexedDataset
from mtnlg_jax.data.tokenizer import Tokenizer
from mtnlg_jax.data.tokenizer import load as load_tokenizer
from support import launch_module
from test_data import synthetic_documents

ROOT = pathlib.Path(__file__).resolve().parents[1]


def preprocess(*args):
    return launch_module('preprocess').main([str(a) for a in args])


@pytest.fixture(scope='module', autouse=True)
def embedded_ray():
    """One embedded Ray for the module: preprocess.tokenize uses it instead of starting its
    own per call (ray_engine.started takes a Ray already running in the process)."""
    with ray_engine.started(2, object_store_mb=80):
        yield


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A jsonl file and a folder of plain-text files; returns (paths, their documents in order)."""
    root = tmp_path_factory.mktemp('raw')
    docs = synthetic_documents(30)
    lines = [json.dumps({'text': d, 'id': i}) for i, d in enumerate(docs[:20])]
    (root / 'a.jsonl').write_text('\n'.join(lines[:10] + [''] + lines[10:]) + '\n')
    (root / 'folder' / 'deeper').mkdir(parents=True)
    for i, doc in enumerate(docs[20:25]):
        (root / 'folder' / f'{i}.txt').write_text(doc)
    for i, doc in enumerate(docs[25:]):
        (root / 'folder' / 'deeper' / f'{i}.py').write_text(doc)
    (root / 'folder' / '.hidden').write_text('never read')
    (root / 'folder' / 'empty.txt').write_text('')
    return [root / 'a.jsonl', root / 'folder'], docs


@pytest.fixture(scope='module')
def tokenizer(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp('tok') / 'tokenizer.model'
    args = ['--train-tokenizer', '--vocab-size', 320, '--tokenizer-model', path]
    assert preprocess('--input', *corpus[0], *args) == 0
    return Tokenizer(str(path))


def test_every_document_comes_back_in_order_with_an_eod_token(corpus, tokenizer, tmp_path):
    paths, docs = corpus
    prefix = tmp_path / 'out'
    assert preprocess('--input', *paths, '--tokenizer-model', tokenizer.model_path,
                      '--output-prefix', prefix, '--append-eod') == 0  # fmt: skip
    dataset = IndexedDataset(str(prefix))
    assert dataset.dtype == np.uint16 and len(dataset) == len(docs)
    for i, doc in enumerate(docs):
        assert dataset[i][-1] == tokenizer.eod_id
        assert tokenizer.decode(dataset[i]) == doc
    assert int((dataset.tokens == tokenizer.eod_id).sum()) == len(docs)


def test_a_tokenizer_json_writes_documents_that_start_with_bos(tmp_path):
    """A Hugging Face tokenizer.json (Llama 3's kind, test_hf_tokenizer.py's): each document
    is its encode_document, BOS first and EOD last (here, on the module's embedded Ray)."""
    from test_hf_tokenizer import TEXT, TOKENIZER_JSON

    docs = [TEXT, 'And the earth was without form.', 'x = 1\n']
    (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    assert preprocess('--input', tmp_path / 'in.jsonl', '--tokenizer-model', TOKENIZER_JSON,
                      '--output-prefix', tmp_path / 'out', '--append-eod') == 0  # fmt: skip
    dataset = IndexedDataset(str(tmp_path / 'out'))
    tok = load_tokenizer(str(TOKENIZER_JSON))
    assert tok.bos_id == 318 and tok.eod_id == 319
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(dataset[i], tok.encode_document(doc))


def test_gpt2_bpe_with_megatrons_flags_one_dataset_per_json_key(tmp_path):
    """A byte-level BPE trained by `tokenizers`, saved as vocab.json/merges.txt, then
    Megatron's command line: every document of each key decodes back to its text."""
    docs = [
        dict(text=d, title=f'Title {i}: é 漢字', id=i)
        for i, d in enumerate(synthetic_documents(12))
    ]
    (tmp_path / 'c.jsonl').write_text('\n'.join(json.dumps(d) for d in docs) + '\n')
    vocab, merges = tmp_path / 'bpe' / 'vocab.json', tmp_path / 'bpe' / 'merges.txt'
    assert preprocess('--input', tmp_path / 'c.jsonl', '--train-tokenizer', '--vocab-size', 300,
                      '--tokenizer-type', 'GPT2BPETokenizer', '--vocab-file', vocab,
                      '--merge-file', merges) == 0  # fmt: skip
    bpe = load_tokenizer(str(tmp_path / 'bpe'))
    assert bpe.kind == 'GPT2BPETokenizer' and bpe.vocab_size == 300 and bpe.eod_id == 299
    for eod in (True, False):
        prefix = tmp_path / f'out{eod}'
        assert preprocess('--input', tmp_path / 'c.jsonl', '--json-keys', 'text', 'title',
                          '--tokenizer-type', 'GPT2BPETokenizer', '--vocab-file', vocab,
                          '--merge-file', merges, '--output-prefix', prefix, '--workers', 2,
                          *(['--append-eod'] if eod else [])) == 0  # fmt: skip
        for key in ('text', 'title'):
            dataset = IndexedDataset(f'{prefix}_{key}_document')
            assert len(dataset) == len(docs)
            for i, doc in enumerate(docs):
                assert (dataset[i][-1] == bpe.eod_id) == eod
                assert bpe.decode(dataset[i]) == doc[key]


def test_two_workers_write_the_same_files_as_one(corpus, tokenizer, tmp_path):
    for workers in (1, 2):
        assert preprocess('--input', *corpus[0], '--tokenizer-model', tokenizer.model_path,
                          '--output-prefix', tmp_path / f'w{workers}', '--workers', workers,
                          '--piece-mb', 0.001) == 0  # fmt: skip
    for suffix in ('.bin', '.idx'):
        assert (tmp_path / f'w1{suffix}').read_bytes() == (tmp_path / f'w2{suffix}').read_bytes()


def test_the_output_folder_is_made_and_the_tokenizer_named_beside_the_files(
    corpus, tokenizer, tmp_path
):
    prefix = tmp_path / 'new' / 'folder' / 'text'
    args = ['--tokenizer-model', tokenizer.model_path, '--output-prefix', prefix]
    assert preprocess('--input', *corpus[0], *args) == 0
    assert sorted(os.listdir(prefix.parent)) == ['text.bin', 'text.identity.json', 'text.idx']
    assert identity.read(str(prefix))['identity'] == tokenizer.identity


def test_train_only_writes_a_usable_deterministic_tokenizer(corpus, tokenizer, tmp_path):
    path = tmp_path / 'again.model'
    args = ['--train-tokenizer', '--vocab-size', 320, '--tokenizer-model', path]
    assert preprocess('--input', *corpus[0], *args) == 0
    assert Tokenizer(str(path)).identity == tokenizer.identity
    assert sorted(os.listdir(tmp_path)) == ['again.model', 'again.vocab']


@pytest.fixture(scope='module')
def earlier(tokenizer, tmp_path_factory):
    """An earlier output (of one plain-text document) that a failed run must leave as it was."""
    folder = tmp_path_factory.mktemp('earlier')
    (folder / 'ok.txt').write_text('fine')
    assert preprocess('--input', folder / 'ok.txt', '--tokenizer-model',
                      tokenizer.model_path, '--output-prefix', folder / 'out') == 0  # fmt: skip
    return {suffix: (folder / f'out{suffix}').read_bytes() for suffix in ('.bin', '.idx')}


@pytest.mark.parametrize(
    'make_input,extra,message',
    [
        (lambda d: d / 'missing.jsonl', [], 'missing.jsonl: no such file'),
        (lambda d: d / 'bad.jsonl', [], 'bad.jsonl:2: not a JSON object with a string'),
        (lambda d: d / 'latin1.txt', [], 'latin1.txt: not UTF-8'),
        (lambda d: d / 'bad.jsonl', ['--train-tokenizer'], 'bad.jsonl:2: not a JSON object'),
        (lambda d: d / 'ok.txt', ['--train-tokenizer', '--vocab-size', '10'], '--vocab-size'),
        (lambda d: d / 'ok.txt', ['--workers', '0'], '--workers'),
        (lambda d: d / 'ok.txt', ['--stall_timeout_s', '-1'], '--stall_timeout_s must be >= 0'),
        (lambda d: d / 'ok.txt', ['--tokenizer-model', 'none.model'], 'none.model: no such'),
        (lambda d: d / 'empty.jsonl', [], '--input'),  # no documents at all
        (
            lambda d: d / 'ok.txt',
            ['--tokenizer-model', str(ROOT / 'README.md')],
            'not a sentencepiece',
        ),
        (  # a folder that cannot be made (new folders are: test_the_output_folder_is_made)
            lambda d: d / 'ok.txt',
            ['--output-prefix', str(ROOT / 'README.md' / 'out')],
            'README.md is not a folder',
        ),
        (lambda d: d / 'ok.txt', ['--vocab-file', 'v.json'], '--tokenizer-model is sentencepie'),
        (lambda d: d / 'ok.txt', ['--json-keys', 'a', 'b'], 'several --json-keys need jsonl'),
    ],
)
def test_bad_input_is_one_error_line_and_earlier_output_is_kept(
    tokenizer, earlier, tmp_path, capsys, make_input, extra, message
):
    (tmp_path / 'bad.jsonl').write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / 'latin1.txt').write_bytes('caf\xe9'.encode('latin-1'))
    (tmp_path / 'ok.txt').write_text('fine')
    (tmp_path / 'empty.jsonl').write_text('\n')
    prefix = tmp_path / 'out'
    for suffix in ('.bin', '.idx'):
        (tmp_path / f'out{suffix}').write_bytes(earlier[suffix])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    model = tmp_path / 'tok.model' if '--train-tokenizer' in extra else tokenizer.model_path
    capsys.readouterr()
    args = ['--input', make_input(tmp_path), '--tokenizer-model', model, '--output-prefix', prefix]
    assert preprocess(*args, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0], err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
