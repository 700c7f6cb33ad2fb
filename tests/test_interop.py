"""Interop on one small run: a byte-level BPE trained by `tokenizers` in GPT-2's file format,
a corpus preprocessed with Megatron's flags, launch/train.py on it, then launch/generate.py,
the lm-evaluation-harness model class and launch/harness.py on the example tasks, and the HF
export with its tokenizer: each agrees with this project's own scorer, generator and tasks."""

import atexit
import json
import os
import shutil
import stat
import tempfile

import pytest
import tokenizers
from lm_eval.api.instance import Instance
from support import (
    ROOT,
    SMALL_MODEL,
    TRAIN_ENV,
    launch_in_process,
    launch_module,
    run_launch,
    run_train,
    train_args,
)
from test_data import synthetic_documents
from test_hf_gpt2 import convert  # launch/convert.py, imported once per process
from test_preprocess import preprocess

from mtnlg_jax.data import tokenizer as tokenizer_lib
from mtnlg_jax.eval import tasks
from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.harness import HarnessModel
from mtnlg_jax.eval.scoring import Scorer, continuation_row

TASKS = ROOT / 'harness_tasks'
PROMPT = 'In the beginning God'
KJV = [json.loads(line)['text'] for line in open(TASKS / 'data/lambada_local.jsonl')]
# Hugging Face datasets' cache of the example tasks, away from the user's own.
HF_HOME = tempfile.mkdtemp(prefix='mtnlg_jax_test_hf_home_')
atexit.register(shutil.rmtree, HF_HOME, True)


def run(script, *args):
    return run_launch(script, *args, env=dict(TRAIN_ENV, HF_HOME=HF_HOME))


@pytest.fixture(scope='module')
def bpe_run(tmp_path_factory):
    """(workdir, tokenizer): a 300-piece BPE, the corpus under Megatron's flags, 4 steps."""
    root = tmp_path_factory.mktemp('bpe_run')
    docs = synthetic_documents(60) + KJV * 20
    (root / 'corpus.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    bpe = ['--tokenizer-type', 'GPT2BPETokenizer', '--vocab-file', root / 'bpe/vocab.json',
           '--merge-file', root / 'bpe/merges.txt']  # fmt: skip
    assert preprocess('--input', root / 'corpus.jsonl', '--train-tokenizer',
                      '--vocab-size', 300, *bpe) == 0  # fmt: skip
    megatron = ['--json-keys', 'text', *bpe, '--append-eod', '--workers', 2]
    assert preprocess('--input', root / 'corpus.jsonl', '--output-prefix', root / 'corpus',
                      *megatron) == 0  # fmt: skip
    workdir = root / 'run'
    result = run_train(
        workdir,
        *SMALL_MODEL,
        '--config.model.init_std=0.3',  # peaked logits: greedy choices by clear margins
        '--config.optimizer.lr=1e-4',
        '--config.optimizer.min_lr=1e-5',
        '--config.train.steps=4',
        '--config.train.eval_batches=1',
        f'--config.data.tokenizer={root / "bpe"}',
        data=root / 'corpus_text_document',
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, tokenizer_lib.load(str(root / 'bpe'))


@pytest.fixture(scope='module')
def harness_model(bpe_run):
    workdir, _ = bpe_run
    return HarnessModel(str(workdir), data='2', tensor='2', batch_size='4', max_gen_toks='12')


def launch_main(script, *args):
    return launch_module(script).main([str(a) for a in args])


def test_generate_and_the_harness_greedy_generation_agree(bpe_run, harness_model, tmp_path, capsys):
    workdir, bpe = bpe_run
    output = tmp_path / 'out.json'
    launch_main('generate', '--workdir', workdir, '--prompt', PROMPT, '--max_new_tokens', 12,
                '--tensor', 2, '--output', output)  # fmt: skip
    record = json.loads(output.read_text())
    assert record['settings']['do_sample'] is False and record['settings']['max_new_tokens'] == 12
    (completion,) = record['completions']
    assert capsys.readouterr().out == PROMPT + completion['completion'] + '\n'
    assert completion['completion'] == bpe.decode(completion['tokens'])
    requests = [
        Instance('generate_until', {}, (PROMPT, dict(until=[], max_gen_toks=12)), 0),
        Instance('generate_until', {}, (KJV[3], dict(until=['\n'], do_sample=False)), 1),
    ]
    generated = harness_model.generate_until(requests, disable_tqdm=True)
    assert generated[0] == completion['completion']
    assert '\n' not in generated[1]


def test_harness_loglikelihoods_equal_the_scorers(bpe_run, harness_model):
    workdir, bpe = bpe_run
    pairs = [('In the beginning God created the', ' heaven'), ('And God said, ', 'Let there')]
    requests = [Instance('loglikelihood', {}, pair, i) for i, pair in enumerate(pairs)]
    results = harness_model.loglikelihood(requests, disable_tqdm=True)
    scorer = Scorer(workdir_lib.load(workdir, data=2, tensor=2), progress=False)
    rows = [continuation_row(*tasks.encode_pair(bpe.encode, *pair), 32) for pair in pairs]
    log_prob, greedy, _ = scorer(rows)
    for (value, is_greedy), expected, expected_greedy in zip(results, log_prob, greedy):
        assert value == pytest.approx(expected, abs=1e-5) and is_greedy == expected_greedy
    # Rolling: disjoint windows of seq_len after the eod token, i.e. the perplexity task's
    # windows without overlap over [eod] + the text's tokens, for a text of 3 x seq_len tokens
    # (the harness's last window of any other length keeps a full window of context).
    text = bpe.decode(bpe.encode(' '.join(KJV))[: 3 * 32])
    tokens = [bpe.eod_id] + bpe.encode(text)
    assert len(tokens) == 3 * 32 + 1
    (rolling,) = harness_model.loglikelihood_rolling(
        [Instance('loglikelihood_rolling', {}, (text,), 0)], disable_tqdm=True
    )
    expected = tasks.perplexity(scorer, tokens, 32, 0)
    assert rolling == pytest.approx(-expected['loss'] * expected['targets'], rel=1e-5)


def test_harness_command_line_runs_the_example_tasks_as_evaluate_scores_them(bpe_run, tmp_path):
    workdir, bpe = bpe_run
    result = run('harness.py', '--workdir', workdir, '--tensor', 2, '--data_parallel', 2,
                 '--tasks', 'mtnlg_lambada_local,mtnlg_choice_local', '--only_include_path',
                 '--include_path', TASKS, '--output_path', tmp_path / 'results')  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / 'results') for f in fs]
    results = json.loads(open(path).read())['results']
    scorer = Scorer(workdir_lib.load(workdir, data=2, tensor=2), progress=False)
    lambada, _ = tasks.lambada(scorer, bpe.encode, KJV, 32)
    items = tasks.read_jsonl(TASKS / 'data/choice_local.jsonl', dict(context=str))
    choice, _ = tasks.multiple_choice(scorer, bpe.encode, items, 32)
    assert results['mtnlg_lambada_local']['acc,none'] == pytest.approx(lambada['accuracy'])
    assert results['mtnlg_choice_local']['acc,none'] == pytest.approx(choice['accuracy'])
    assert results['mtnlg_choice_local']['acc_bytes,none'] == pytest.approx(choice['accuracy_norm'])


def test_hf_export_writes_the_bpe_that_tokenizers_loads_with_normal_file_modes(bpe_run, tmp_path):
    workdir, bpe = bpe_run
    exported = tmp_path / 'hf'
    convert.export_hf(str(exported), str(workdir), None)  # the run's tokenizer by default
    umask = os.umask(0)
    os.umask(umask)
    for name in ('config.json', 'model.safetensors', 'vocab.json', 'merges.txt', 'tokenizer.json'):
        assert stat.S_IMODE(os.stat(exported / name).st_mode) == 0o666 & ~umask, name
    text = KJV[6] + '\n\tdef f(x):  return x  # é 漢字'
    loaded = tokenizers.Tokenizer.from_file(str(exported / 'tokenizer.json'))
    assert loaded.encode(text).ids == bpe.encode(text)
    assert loaded.decode(bpe.encode(text)) == text
    from_files = tokenizer_lib.load(str(exported))  # vocab.json + merges.txt
    assert from_files.identity == bpe.identity
    config = json.loads((exported / 'config.json').read_text())
    assert config['eos_token_id'] == bpe.eod_id == 299


def test_harness_command_line_errors_are_one_line(bpe_run):
    workdir, _ = bpe_run
    for args, message in (
        (['--tasks', 'x', '--include_path', 'missing_dir'], '--include_path missing_dir: no such'),
        (['--include_path', str(TASKS)], '--tasks is required'),
        (['--tasks', 'x', '--model', 'hf'], '--model and --model_args are set by'),
        (['--tasks', 'x', '--tensor', '3'], 'config key model.heads'),
    ):
        result = run('harness.py', '--workdir', workdir, *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
        assert lines[0].startswith('error: ') and message in lines[0], lines


def test_training_refuses_a_tokenizer_that_does_not_fit_the_model(
    bpe_run, tmp_path, capsys, monkeypatch
):
    """train's main(argv) in this process (its command line's bad input:
    test_command_line_contract.py)."""
    workdir, _ = bpe_run
    bpe_dir = workdir.parent / 'bpe'
    args = train_args(tmp_path / 'w', *SMALL_MODEL, '--config.model.vocab_size=320',
                      f'--config.data.tokenizer={bpe_dir}',
                      data=workdir.parent / 'corpus_text_document')[2:]  # fmt: skip
    status, _, lines = launch_in_process('train', capsys, monkeypatch, *args)
    assert status == 2 and not (tmp_path / 'w').exists()
    assert lines == [
        f'error: config key data.tokenizer: {bpe_dir} (GPT2BPETokenizer) has 300 pieces, but '
        "the model's vocabulary (model.vocab_size) is 320 (--config.data.tokenizer= trains on "
        'token ids with none)'
    ]
