"""launch/evaluate.py and launch/generate.py as a user runs them, on a workdir imported from
a small Hugging Face GPT-2 with a small sentencepiece tokenizer: their figures and text equal
the library's, and bad input fails with one line before anything is compiled."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from support import launch_in_process
from support import run_launch as run
from test_hf_gpt2 import hf_gpt2_logits, original  # noqa: F401

from mtnlg_jax.data.gpt_dataset import split_ranges
from mtnlg_jax.data.indexed import IndexedDatasetWriter
from mtnlg_jax.data.tokenizer import Tokenizer
from mtnlg_jax.eval import tasks
from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.generation import Generator
from mtnlg_jax.eval.scoring import Scorer

TEXT = ' '.join(f'In the beginning {w} was the word {i} .' for i, w in enumerate('abcdefg' * 4))


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp('tokenizer')
    return Tokenizer.train([TEXT] * 20, str(directory / 'tok'), vocab_size=300)


def snapshot(directory):
    return sorted(
        (
            os.path.relpath(os.path.join(root, name), directory),
            os.path.getsize(os.path.join(root, name)),
        )
        for root, _, names in os.walk(directory)
        for name in names
    )


def test_perplexity_of_an_indexed_dataset_split(original, tmp_path):  # noqa: F811
    _, workdir = original
    prefix = str(tmp_path / 'corpus')
    documents = np.random.default_rng(5).integers(0, 300, (10, 50))
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for document in documents:
        writer.add(document)
    writer.finish()
    result = run(
        'evaluate.py',
        *('--workdir', workdir, '--task', 'perplexity', '--data', prefix, '--split', 'train'),
        *('--overlap', 8),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = workdir / 'eval' / 'perplexity_corpus_train_step0.json'  # task, data, split, step
    assert result.stdout.strip().endswith(f'wrote {output}')
    train_documents = split_ranges(workdir_lib.read_saved_config(workdir)['data']['split'], 10)
    first, stop = train_documents['train']
    tokens = documents[first:stop].reshape(-1)
    scorer = Scorer(workdir_lib.load(workdir), progress=False)
    expected = tasks.perplexity(scorer, tokens, 32, 8)
    record = json.loads(output.read_text())
    assert record['tokens'] == tokens.size
    assert record['token_perplexity'] == pytest.approx(expected['token_perplexity'], rel=1e-5)


def test_perplexity_of_a_text_file_with_megatron_word_normalisation(original, tokenizer, tmp_path):  # noqa: F811
    _, workdir = original
    (tmp_path / 'wiki.txt').write_text(TEXT)
    output = tmp_path / 'ppl.json'
    result = run(
        'evaluate.py',
        *('--workdir', workdir, '--task', 'perplexity', '--data', tmp_path / 'wiki.txt'),
        *('--overlap', 8, '--count_words', '--tokenizer', tokenizer.model_path),
        *('--tensor', 4, '--data_parallel', 2, '--output', output),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert '| word_perplexity' in result.stdout
    record = json.loads(output.read_text())
    tokens = tokenizer.encode(TEXT)
    scorer = Scorer(workdir_lib.load(workdir), progress=False)
    expected = tasks.perplexity(scorer, tokens, 32, 8, num_words=len(TEXT.split(' ')))
    assert record['step'] == 0 and record['mesh'].startswith('data 2 x tensor 4')
    assert record['words'] == len(TEXT.split(' '))
    assert record['token_perplexity'] == pytest.approx(expected['token_perplexity'], rel=1e-5)
    assert record['word_perplexity'] == pytest.approx(
        math.exp(record['loss'] * (len(tokens) - 1) / (record['words'] - 1)), rel=1e-6
    )


def test_generate_streams_the_greedy_completion_of_the_library(original, tokenizer, tmp_path):  # noqa: F811
    """Without XLA_FLAGS, as the README runs it: the tool makes its CPU devices itself."""
    _, workdir = original
    output = tmp_path / 'out.json'
    result = run(
        'generate.py',
        *('--workdir', workdir, '--prompt', 'In the beginning', '--max_new_tokens', 10),
        *('--tokenizer', tokenizer.model_path, '--tensor', 2, '--output', output),
        env={k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(output.read_text())
    settings = written['settings']
    assert settings['do_sample'] is False and settings['max_new_tokens'] == 10
    assert settings['seed'] == 0 and settings['use_cache'] is True
    record = written['completions'][0]
    loaded = workdir_lib.load(workdir, data=1, tensor=1)
    generate = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    expected = generate([tokenizer.encode('In the beginning')], 10, eod_id=tokenizer.eod_id)[0]
    assert record['tokens'] == expected
    assert result.stdout == 'In the beginning' + tokenizer.decode(expected) + '\n'


@pytest.fixture(scope='module')
def broken(original, tmp_path_factory):  # noqa: F811
    """Copies of the imported workdir whose checkpoint cannot serve their config: another
    model, positions beyond the stored table, truncated files, no orbax checkpoint at all;
    and an indexed dataset prefix."""
    _, workdir = original
    root = tmp_path_factory.mktemp('broken')

    def copy(name, **model):
        target = root / name
        shutil.copytree(workdir, target)
        saved = json.loads((target / 'config.json').read_text())
        for section in (saved, saved['inputs']):
            section['model'].update(model)
        (target / 'config.json').write_text(json.dumps(saved))
        return target

    copy('other_model', hidden=128)
    copy('long_positions', seq_len=64)
    for path in (copy('truncated') / 'checkpoints').rglob('*'):
        if path.is_file():
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    not_orbax = copy('not_orbax')
    shutil.rmtree(not_orbax / 'checkpoints')
    (not_orbax / 'checkpoints' / '0').mkdir(parents=True)
    (not_orbax / 'checkpoints' / '0' / 'state').write_text('not a checkpoint')
    writer = IndexedDatasetWriter(str(root / 'tokens'), np.uint16)
    writer.add(np.arange(50))
    writer.finish()
    return root


@pytest.mark.parametrize(
    'script,workdir,args,message',
    [
        (
            'evaluate.py',
            None,
            ['--task', 'lambada', '--data', 'missing.jsonl'],
            '--data missing.jsonl: no such file',
        ),
        (
            'evaluate.py',
            None,
            ['--task', 'perplexity', '--data', 'x', '--batch_size', '0'],
            '--batch_size must be',
        ),
        (
            'evaluate.py',
            None,
            ['--task', 'squad', '--data', 'x'],
            "argument --task: invalid choice: 'squad'",
        ),
        ('generate.py', None, ['--prompt', 'x', '--tensor', '3'], 'config key model.heads: 8'),
        (
            'generate.py',
            None,
            ['--prompt', 'x', '--do_sample', '--temperature', '-1'],
            '--temperature must be',
        ),
        (
            'evaluate.py',
            None,
            ['--task', 'lambada', '--data', '{root}/tokens'],
            'an indexed dataset; --task lambada reads a .jsonl file',
        ),
        (
            'evaluate.py',
            'other_model',
            ['--task', 'perplexity', '--data', '{root}/tokens', '--overlap', '8'],
            'does not fit this model: params/',
        ),
        (
            'generate.py',
            'long_positions',
            ['--prompt', 'In', '--tokenizer', '{tokenizer}', '--max_new_tokens', '8'],
            'params/position_embed has shape (32, 64) in the checkpoint but (64, 64)',
        ),
        ('convert.py', 'truncated', ['--export_hf', '{root}/out'], 'checkpoints/0 is unreadable'),
        (
            'evaluate.py',
            'not_orbax',
            ['--task', 'perplexity', '--data', '{root}/tokens', '--overlap', '8'],
            'checkpoints/0 is unreadable',
        ),
    ],
)
def test_bad_input_fails_with_one_line(
    original,  # noqa: F811 (the fixture imported from test_hf_gpt2)
    broken,
    tokenizer,
    capsys,
    monkeypatch,
    script,
    workdir,
    args,
    message,
):
    """In this process (test_command_line_contract.py runs each tool's command line)."""
    workdir = broken / workdir if workdir else original[1]
    before = snapshot(broken)
    fill = dict(root=broken, tokenizer=tokenizer.model_path)
    status, _, lines = launch_in_process(
        script.removesuffix('.py'), capsys, monkeypatch, '--workdir', workdir,
        *(a.format(**fill) for a in args),
    )  # fmt: skip
    assert status == 2, lines
    assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], lines
    assert snapshot(broken) == before  # no eval/ results, no export written


@pytest.mark.parametrize(
    'args,message',
    [
        (['--temperature', '0.5'], '--temperature shapes sampling: add --do_sample'),
        (['--max_new_tokens', '30'], 'max_new_tokens 30: a prompt of 3 tokens leaves room for 29'),
        (['--num_return_sequences', '0'], 'num_return_sequences must be a positive integer'),
    ],
)
def test_bad_generation_settings_fail_with_one_line(
    original,  # noqa: F811
    tokenizer,
    capsys,
    monkeypatch,
    args,
    message,
):
    _, workdir = original
    prompt = tokenizer.decode(tokenizer.encode('In the beginning')[:3])
    assert len(tokenizer.encode(prompt)) == 3
    status, _, lines = launch_in_process('generate', capsys, monkeypatch, '--workdir', workdir,
                                         '--prompt', prompt, '--tokenizer', tokenizer.model_path,
                                         *args)  # fmt: skip
    assert status == 2
    assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], lines


def test_scorer_sums_log_probabilities_and_flags_rows_of_argmax_tokens(original):  # noqa: F811
    tensors, workdir = original
    loaded = workdir_lib.load(workdir, data=4, tensor=2)
    generate = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    greedy = [7] + generate([[7]], 31)[0]  # every target is the argmax
    not_greedy = greedy[:-1] + [(greedy[-1] + 1) % 300]  # but the last
    random = list(np.random.default_rng(4).integers(0, 300, 32))
    mask = np.ones(31, bool)
    log_prob, all_argmax, count = Scorer(loaded, progress=False)(
        [(np.array(t), mask) for t in (greedy, not_greedy, random)] + [(np.array(random), ~mask)]
    )
    assert all_argmax.tolist() == [True, False, False, True]  # an empty mask holds vacuously
    assert count.tolist() == [31, 31, 31, 0]
    for tokens, value in zip((greedy, not_greedy, random), log_prob):
        logits = hf_gpt2_logits(tensors, np.array(tokens[:-1]))
        shifted = logits - logits.max(-1, keepdims=True)
        log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        assert value == pytest.approx(log_softmax[np.arange(31), tokens[1:]].sum(), abs=1e-3)
