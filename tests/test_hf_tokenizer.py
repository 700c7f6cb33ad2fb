"""data.tokenizer as a Hugging Face tokenizer.json (Llama 3's kind), and the tokenizer files a
Hugging Face export writes beside the weights for each kind (a sentencepiece run's included)."""

import json
import pathlib
import shutil

import pytest
import tokenizers
from test_preprocess import preprocess

from mtnlg_jax.data import tokenizer as tokenizer_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKENIZER_JSON = ROOT / 'tests/fixtures/hf_llama/llama/tokenizer.json'
SENTENCEPIECE = ROOT / 'tests/fixtures/curation/planted.tokenizer.model'
TEXT = 'In the beginning God created the heaven.\n    def main(argv):  # ünïcode 12345'


def test_a_tokenizer_json_encodes_as_the_tokenizers_library_with_bos_first_and_eod_last():
    tok = tokenizer_lib.load(str(TOKENIZER_JSON))
    reference = tokenizers.Tokenizer.from_file(str(TOKENIZER_JSON))
    assert tok.kind == 'HuggingFaceTokenizer' and tok.vocab_size == 320
    assert tok.eod_id == reference.token_to_id('<|end_of_text|>') == 319
    assert tok.bos_id == reference.token_to_id('<|begin_of_text|>') == 318
    ids = tok.encode(TEXT)
    assert ids == reference.encode(TEXT, add_special_tokens=False).ids
    assert tok.encode_document(TEXT) == [318] + ids + [319]
    assert tok.decode(tok.encode_document(TEXT)) == TEXT
    assert len(tok.identity) == 64


def test_a_directory_holding_tokenizer_json_opens_it(tmp_path):
    shutil.copy(TOKENIZER_JSON, tmp_path / 'tokenizer.json')
    assert tokenizer_lib.load(str(tmp_path)).kind == 'HuggingFaceTokenizer'


def test_the_eos_token_of_a_tokenizer_config_beside_it_is_the_eod(tmp_path):
    shutil.copy(TOKENIZER_JSON, tmp_path / 'tokenizer.json')
    eos = {'content': '<|begin_of_text|>', 'special': True}  # as Llama 3's configs spell it
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': eos}))
    assert tokenizer_lib.load(str(tmp_path / 'tokenizer.json')).eod_id == 318


def test_bad_tokenizer_json_files_are_one_error_naming_the_file(tmp_path):
    (tmp_path / 'tokenizer.json').write_text('{"not": "a tokenizer"}')
    with pytest.raises(tokenizer_lib.TokenizerError, match='not a Hugging Face tokenizer.json'):
        tokenizer_lib.load(str(tmp_path / 'tokenizer.json'))
    plain = tokenizers.Tokenizer(tokenizers.models.WordLevel({'a': 0, '[UNK]': 1}, '[UNK]'))
    plain.save(str(tmp_path / 'no_eod.json'))
    with pytest.raises(tokenizer_lib.TokenizerError, match='no end-of-document token') as error:
        tokenizer_lib.load(str(tmp_path / 'no_eod.json'))
    assert str(tmp_path / 'no_eod.json') in str(error.value)


def test_preprocess_refuses_to_train_a_tokenizer_json(tmp_path, capsys):
    (tmp_path / 'in.jsonl').write_text('{"text": "a"}\n')
    assert preprocess('--input', tmp_path / 'in.jsonl', '--tokenizer-type', 'HuggingFaceTokenizer',
                      '--tokenizer-model', TOKENIZER_JSON, '--train-tokenizer') == 2  # fmt: skip
    assert capsys.readouterr().err.startswith('error: --train-tokenizer')


@pytest.mark.parametrize(
    'source, files, tokenizer_class',
    [
        (TOKENIZER_JSON, ['tokenizer.json'], 'PreTrainedTokenizerFast'),
        (SENTENCEPIECE, ['tokenizer.model'], 'LlamaTokenizer'),
    ],
)
def test_an_export_writes_the_tokenizer_with_its_config(tmp_path, source, files, tokenizer_class):
    alone = tmp_path / 'source' / source.name  # without the tokenizer config beside it
    alone.parent.mkdir()
    shutil.copy(source, alone)
    tmp_path = tmp_path / 'out'
    tmp_path.mkdir()
    tok = tokenizer_lib.load(str(alone))
    written = tok.export(str(tmp_path), 64)
    assert written == files + ['tokenizer_config.json', 'special_tokens_map.json']
    config = json.loads((tmp_path / 'tokenizer_config.json').read_text())
    assert config['tokenizer_class'] == tokenizer_class and config['model_max_length'] == 64
    assert config['eos_token'] == tok.id_to_piece(tok.eod_id)
    assert tokenizer_lib.load(str(tmp_path / files[0])).encode(TEXT) == tok.encode(TEXT)


def test_an_export_keeps_the_tokenizer_config_that_came_with_the_tokenizer(tmp_path):
    tok = tokenizer_lib.load(str(TOKENIZER_JSON))
    tok.export(str(tmp_path), 64)
    assert (tmp_path / 'tokenizer_config.json').read_text() == json.dumps(
        json.loads((TOKENIZER_JSON.parent / 'tokenizer_config.json').read_text()), indent=2
    )
