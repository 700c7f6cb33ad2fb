"""launch/train.py as a user runs it: bad input fails fast and cleanly; a run leaves
config.json, metrics.jsonl, tensorboard events and a loss-curve PNG."""

import json
import os
import subprocess
import sys

import jax
import pytest

from support import ROOT, SMALL_MODEL, TRAIN_ENV, launch_in_process, run_train, train_args

from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.generation import Generator


def untouched(workdir):
    workdir.mkdir()
    (workdir / 'metrics.jsonl').write_text('{"step": 1, "loss": 1.0}\n')
    return workdir


def assert_untouched(workdir):
    assert sorted(os.listdir(workdir)) == ['metrics.jsonl']
    assert (workdir / 'metrics.jsonl').read_text() == '{"step": 1, "loss": 1.0}\n'


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
                '--config.mesh.stage=1',
                '--config.mesh.tensor=8',
            ],
            'model.heads',
        ),
        (['--config.model.ffn_hidden=1001'], 'model.ffn_hidden'),
        (['--config.train.global_batch=18'], 'train.global_batch'),  # not a multiple of 2 x 2
        (  # GPipe's circular order: 1 micro-batch for 2 stages (1F1B takes it)
            [
                '--config.train.global_batch=4',
                '--config.train.rampup.start=0',
                '--config.pipeline.schedule=gpipe',
            ],
            'train.global_batch',
        ),
        (  # the ramp's first batch is 1 micro-batch for 2 stages
            [
                '--config.train.rampup.start=4',
                '--config.train.rampup.increment=4',
                '--config.pipeline.schedule=gpipe',
            ],
            'train.rampup.start',
        ),
        (['--config.pipeline.schedule=zigzag'], 'pipeline.schedule'),
        (
            ['--config.pipeline.schedule=interleaved', '--config.pipeline.repeats=1'],
            'pipeline.schedule',
        ),
        (['--config.pipeline.max_in_flight=-1'], 'pipeline.max_in_flight'),
        (  # the in-flight bound is for the 1f1b / interleaved tables, not gpipe's scan
            ['--config.pipeline.schedule=gpipe', '--config.pipeline.max_in_flight=2'],
            'pipeline.max_in_flight',
        ),
        (['--config.model.num_layers=3', '--config.pipeline.repeats=2'], 'model.num_layers'),
        (['--config.model.remat=sometimes'], 'model.remat'),
        (['--config.model.compute_dtype=int8'], 'model.compute_dtype'),
        (  # sequence shards over tensor 2 need an even sequence length
            ['--config.model.sequence_parallel=True', '--config.model.seq_len=127'],
            'model.sequence_parallel',
        ),
        (['--config.model.loss_chunks=3'], 'model.loss_chunks'),  # 128 positions in 3 pieces
        (['--config.train.steps=0'], 'train.steps'),
        (['--config.model.no_such_key=1'], 'no_such_key'),
        (['--config.train.steps=many'], 'train.steps'),
        (  # no tokenizer, so the data is what fails (also where data/default was never built)
            ['--config.data.sources=((1.0, "/nonexistent/corpus"),)', '--config.data.tokenizer='],
            '/nonexistent/corpus.idx',
        ),
    ],
)
def test_bad_input_is_one_error_line_exit_2_and_the_workdir_untouched(
    tmp_path, capsys, monkeypatch, overrides, key
):
    """In this process (a subprocess each would cost the suite a minute; the next test runs
    the command line itself)."""
    workdir = untouched(tmp_path / 'run')
    status, _, lines = launch_in_process(
        'train', capsys, monkeypatch, '--config', ROOT / 'configs/tiny.py', '--workdir', workdir,
        *overrides,
    )  # fmt: skip
    assert status == 2, lines
    lines = [line for line in lines if line.strip()]
    assert lines[-1].startswith('error: ') and key in lines[-1], lines
    assert sum(line.startswith('error: ') for line in lines) == 1
    assert_untouched(workdir)


def test_bad_input_at_the_command_line_is_one_line_on_stderr_and_exit_2(tmp_path):
    workdir = untouched(tmp_path / 'run')
    result = run_train(workdir, '--config.mesh.data=3')
    assert result.returncode == 2, result.stderr
    assert result.stderr.count('\n') == 1 and result.stderr.startswith('error: config key mesh')
    assert_untouched(workdir)


def test_token_ids_beyond_the_vocabulary_are_an_error(tmp_path, token_data):
    result = run_train(
        tmp_path / 'run', *SMALL_MODEL, '--config.model.vocab_size=200', data=token_data
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith('error: ')
    assert 'model.vocab_size=200' in result.stderr and 'pattern.bin' in result.stderr
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


LHS_OFF = 'xla_gpu_enable_latency_hiding_scheduler=false'


def test_a_short_run_writes_metrics_events_and_a_loss_curve(tmp_path, token_data):
    workdir = tmp_path / 'run'
    result = run_train(
        workdir,
        *SMALL_MODEL,
        '--config.train.steps=8',
        '--config.train.log_every=2',
        '--config.train.eval_every=4',
        '--config.train.eval_batches=2',
        # a config's own XLA option: checked by XLA, compiled with, named by the banner
        f'--config.train.xla_options={LHS_OFF}',
        data=token_data,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'mesh         data 4 x stage 1 x tensor 2' in result.stdout  # SMALL_MODEL's layout
    assert 'per device   parameters' in result.stdout
    assert f'; train.xla_options {LHS_OFF}' in result.stdout

    config = json.loads((workdir / 'config.json').read_text())
    assert config['train']['micro_steps'] == 2 and config['model']['padded_vocab'] == 512
    assert config['derived']['train']['micro_steps'] == 2
    assert 'micro_steps' not in config['inputs']['train']  # derived, never an input
    assert config['inputs']['data']['sources'] == [[1.0, os.path.abspath(token_data)]]

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


def tensorboard_tags(folder):
    """{tag: [(step, value)]} of the scalar events tensorboardX wrote under `folder` (TFRecord
    framing: length, its CRC, the Event, its CRC)."""
    from tensorboardX.proto import event_pb2  # noqa: PLC0415

    tags = {}
    for path in folder.glob('events.out.tfevents.*'):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            length = int.from_bytes(data[at : at + 8], 'little')
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append((event.step, value.simple_value))
    return tags


def test_a_mixture_of_experts_run_logs_each_layers_expert_load(
    tmp_path, token_data, capsys, monkeypatch
):
    """The reporter's MoE figures of a run over data 2 x expert 2 x tensor 2: every layer's
    largest expert load over the mean and the dropped share in metrics.jsonl, tensorboard
    (one tag a layer) and the run's own output (the progress bar's load and drop, a line by
    layer beside the validation loss); the banner names the experts and the active
    parameters. The workdir loader restores the run onto expert 1 (data x tensor) and 4, where
    generation's KV cache gives the recomputed sequence's tokens."""
    workdir = tmp_path / 'run'
    args = train_args(
        workdir,
        *SMALL_MODEL,
        '--config.mesh.data=2',
        '--config.mesh.expert=2',
        '--config.model.num_layers=2',
        '--config.model.moe.experts=4',
        '--config.model.moe.top_k=2',
        '--config.model.moe.ffn_hidden=32',
        '--config.model.moe.capacity_factor=1.0',
        '--config.train.steps=4',
        '--config.train.log_every=2',
        '--config.train.eval_every=4',
        '--config.train.eval_batches=1',
        data=token_data,
    )
    # two compiles (train, eval) of a mixture of experts: minutes on a loaded CI machine
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=TRAIN_ENV,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'experts      4 routed, top 2 (softmax router, capacity 1)' in result.stdout
    layer_line = [line for line in result.stdout.splitlines() if 'expert load max / mean' in line]
    assert len(layer_line) == 1 and layer_line[0].startswith('step 4: expert load'), layer_line
    assert len(layer_line[0].split('by layer ')[1].split(';')[0].split()) == 2  # 2 layers
    assert 'load=' in result.stderr and 'drop=' in result.stderr  # tqdm's bar

    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    train = [r for r in records if not r.get('eval')]
    for record in train:
        loads = record['moe_layer_load_max_over_mean']
        assert len(loads) == 2 and all(1.0 <= x <= 4.0 for x in loads)
        assert record['moe_load_max_over_mean'] == pytest.approx(max(loads), abs=1e-4)
        assert 0.0 <= record['moe_dropped_fraction'] < 1.0

    tags = tensorboard_tags(workdir / 'tensorboard')
    for tag in ('train/moe_load_max_over_mean', 'train/moe_dropped_fraction',
                *(f'train/moe_layer_load_max_over_mean/layer_{i}' for i in range(2))):  # fmt: skip
        assert [step for step, _ in tags[tag]] == [2, 4], tag
    last = [tags[f'train/moe_layer_load_max_over_mean/layer_{i}'][-1][1] for i in range(2)]
    assert last == pytest.approx(train[-1]['moe_layer_load_max_over_mean'], abs=1e-4)

    loaded = workdir_lib.load(str(workdir), data=1, tensor=2, dtype='float32')
    assert loaded.config.mesh.expert == 1 and loaded.config.model.moe.experts == 4
    generator = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    [cached] = generator([[5, 17, 42, 7]], 6)
    [recomputed] = generator([[5, 17, 42, 7]], 6, use_cache=False)
    assert cached == recomputed and len(cached) == 6
    # onto 4 expert ranks too (one expert each; the prompts split over them, more data
    # parallelism for all but the experts): the same greedy tokens
    prompts = [[5, 17, 42, 7], [3, 9, 11, 2], [8, 8, 1, 30], [40, 2, 6, 13]]
    whole = generator(prompts, 6)
    split = workdir_lib.load(str(workdir), data=1, tensor=2, dtype='float32', expert=4)
    assert split.mesh.shape['expert'] == 4 and whole[0] == cached
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(split.params)]
    routed = [spec for spec in specs if 'expert' in spec]  # GeLU's in and out kernels
    assert len(routed) == 2 and all(spec[:2] == ('stage', 'expert') for spec in routed), specs
    generator = Generator(split.graphdef, split.params, split.config.model, split.mesh)
    assert generator(prompts, 6) == whole
    needs = dict(
        generate=('--prompt', 'x'), evaluate=('--task', 'perplexity', '--data', 'x'),
        harness=('--tasks', 'x'),
    )  # fmt: skip
    for script in ('generate', 'evaluate', 'harness'):  # 4 experts over 3 ranks: one line
        status, _, lines = launch_in_process(
            script, capsys, monkeypatch, '--workdir', str(workdir), '--expert', '3',
            *needs.get(script, ()),
        )  # fmt: skip
        assert status == 2 and len(lines) == 1, (script, lines)
        assert 'not divisible by mesh.expert=3' in lines[0], (script, lines)
