"""launch/plan.py as a user runs it: a bf16 pipelined step compiles on CPU through it (XLA:CPU
aborts on it without the flags the tool sets), its JSON carries the keys other tools read, and
bad input is one line, exit status 2, nothing written."""

import json
import subprocess
import sys

import pytest

import support

# configs/tiny.py's layout (data 2 x stage 2 x tensor 2, 2 repeats) on a model that compiles
# in seconds, in bf16, in the GPipe order (its v m + p - 1 = 9 iterations are counted below;
# tests/test_pipeline*.py cover the 1F1B engine).
SMALL_BF16 = [
    '--config.model.compute_dtype=bfloat16',
    '--config.model.num_layers=4',
    '--config.model.hidden=64',
    '--config.model.seq_len=32',
    '--config.model.vocab_size=300',
    '--config.train.global_batch=16',
    '--config.train.micro_batch=2',
    '--config.train.rampup.start=0',
    '--config.pipeline.schedule=gpipe',
]


def run_plan(*args):
    command = [sys.executable, str(support.ROOT / 'launch/plan.py'), *args]
    return subprocess.run(
        ['timeout', '-k', '10', '280', *command],
        capture_output=True,
        text=True,
        cwd=support.ROOT,
        env=support.TRAIN_ENV,
    )


def test_a_bf16_pipelined_step_compiles_through_the_tool(tmp_path):
    out = tmp_path / 'plan.json'
    result = run_plan(
        '--config', 'configs/tiny.py', *SMALL_BF16, '--compile', '--cluster', 'h100-80gb',
        '--json', str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(out.read_text())
    assert {'params', 'per_device_bytes', 'model_flops_per_step', 'hardware_flops_per_step',
            'comm_bytes_per_device', 'compiled', 'cluster'} <= set(plan)  # fmt: skip
    assert {'params', 'grads', 'optimizer', 'activations', 'total'} <= set(plan['per_device_bytes'])
    compiled = plan['compiled']
    assert {'argument_bytes', 'output_bytes', 'alias_bytes', 'temp_bytes', 'peak_bytes',
            'flops', 'compile_s', 'collectives'} <= set(compiled)  # fmt: skip
    assert compiled['peak_bytes'] > 0 and compiled['compile_s'] > 0
    # 2 repeats x 4 micro-batches + 2 - 1 = 9 pipeline iterations, each way one hand-off.
    permutes = [
        c for c in compiled['collectives']
        if c['kind'] == 'collective-permute' and c['axes'] == ['stage'] and c['in_loop']
    ]  # fmt: skip
    assert [c['count'] for c in permutes] == [9, 9]
    assert all({'kind', 'axes', 'bytes', 'count', 'in_loop'} <= set(c) for c in permutes)
    assert 'all-reduce-promotion' in result.stdout  # says what differs from a GPU compile
    assert 'planned' in result.stdout and 'compiled' in result.stdout


@pytest.mark.parametrize(
    'args, message',
    [
        (['--cluster', 'tpu-v9'], "--cluster 'tpu-v9' is not one of a100-80gb, h100-80gb"),
        (['--config.mesh.tensor=3'], 'model.heads: 8 heads are not divisible by mesh.tensor=3'),
        (['--devices', '7'], 'mesh: data x stage x tensor = 2 x 2 x 2 = 8, but there are 7'),
        (['--devices', '0'], '--devices must be a positive integer, got 0'),
        (['--config.model.hidden=abc'], 'config.model.hidden'),
        (['--json', 'README.md/plan.json'], '--json README.md/plan.json: '),  # its folder a file
        (['--target', 'h200'], "--target 'h200' is not one of a100-80gb, h100-80gb, h200-141gb"),
        (['--target', 'a100-80gb', '--num_processes', '2'], 'leave out --num_processes'),
        (
            ['--config.train.xla_options=xla_gpu_reduce_scatter_combine_threshold_bytes=abc'],
            "train.xla_options: XLA does not take them: While setting option xla_gpu_reduce",
        ),
        (
            [
                '--target',
                'a100-80gb',
                '--config.mesh.tensor=16',
                '--config.mesh.data=1',
                '--config.mesh.stage=1',
                '--config.model.heads=16',
                '--devices',
                '16',
            ],
            'mesh.tensor 16 with 16 devices: a100-80gb nodes hold 8 GPUs',
        ),
    ],
)
def test_bad_input_is_one_line_and_status_2(args, message, tmp_path, capsys, monkeypatch):
    """In this process (test_command_line_contract.py runs the command line itself)."""
    existing = tmp_path / 'plan.json'
    existing.write_text('keep me')
    json_args = [] if '--json' in args else ['--json', str(existing)]
    monkeypatch.chdir(support.ROOT)
    status, out, lines = support.launch_in_process(
        'plan', capsys, monkeypatch, '--config', 'configs/tiny.py', '--compile', *json_args, *args
    )
    assert status == 2, lines
    assert out == ''
    assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], lines
    assert existing.read_text() == 'keep me'


def test_target_without_the_gpu_compiler_says_what_to_install(tmp_path):
    """Where neither .gpu-compile/ nor the environment has the XLA:GPU compiler."""
    from mtnlg_jax.xla import gpu_compile  # noqa: PLC0415

    if gpu_compile._importable('jax_plugins.xla_cuda12') and not gpu_compile.COMPILER_DIR.is_dir():
        pytest.skip('the compiler is installed in this environment itself')
    command = [sys.executable, str(support.ROOT / 'launch/plan.py'), '--config',
               'configs/tiny.py', '--target', 'a100-80gb']  # fmt: skip
    env = dict(support.TRAIN_ENV, MTNLG_GPU_COMPILE_DIR=str(tmp_path / 'none'))
    result = subprocess.run(command, capture_output=True, text=True, cwd=support.ROOT, env=env)
    assert result.returncode == 2 and result.stdout == ''
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        'error: --target a100-80gb: the XLA:GPU compiler is not installed'
    ), lines
    assert 'make gpu-compile' in lines[0]


def test_missing_config_is_an_error():
    result = run_plan('--compile')
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ') and '--config' in lines[0], lines


def test_a_mixture_of_experts_is_planned_with_its_active_parameters(tmp_path):
    """configs/tiny_moe.py planned (arithmetic only): its experts line and the JSON's moe
    part (8.64 M parameters, 7.02 M active: tests/test_plan_arithmetic.py counts them)."""
    plan_json = tmp_path / 'plan.json'
    result = run_plan(
        '--config', 'configs/tiny_moe.py', '--cluster', 'h100-80gb', '--json', str(plan_json)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'experts      8 routed, top 2, over 1 expert rank(s)' in result.stdout
    assert "all-to-all 0.000 (the experts' rows padded 1 x by the exchange)" in result.stdout
    plan = json.loads(plan_json.read_text())
    assert plan['moe']['active_params'] == 7_022_848 and plan['params'] == 8_644_864
    assert plan['moe']['expert_bytes_per_device']['params'] > 0
