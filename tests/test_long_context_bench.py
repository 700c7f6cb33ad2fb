"""bench/long_context.py's 405B part without compiling: each point's command resolves to the
128K config's layout at its own context and the same tokens a step, and the table reads each
plan (or says why a point failed) with the stubbed compiles writing the fields it reads."""

import json
import subprocess
import sys

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.run import cli

sys.path.insert(0, str(support.ROOT / 'bench'))
import long_context  # noqa: E402

GIB = 2**30
CAUSE = 'error: XLA:GPU could not compile this step for h100-80gb: RESOURCE_EXHAUSTED: ...'
UNCHANGED = (  # what every point keeps of configs/llama3_405b_128k.py
    'train.micro_batch', 'model.remat', 'model.remat_recompute', 'model.sequence_pieces',
    'model.rope_scaling', 'pipeline.repeats', 'pipeline.max_in_flight',
    'pipeline.overlap_grad_reduce', 'data.reset_attention_mask',
)  # fmt: skip


def _resolved(command):
    overrides, rest = cli.split_overrides(command[2:])
    config = cli.apply_overrides(config_lib.load(rest[rest.index('--config') + 1]), overrides)
    return config_lib.resolve(config, int(rest[rest.index('--devices') + 1]))


def _key(config, dotted):
    for name in dotted.split('.'):
        config = config[name]
    return config


def test_each_405b_point_is_the_128k_config_at_its_own_context(tmp_path):
    reference = _resolved(['python', 'launch/plan.py', '--config',
                           'configs/llama3_405b_128k.py', '--devices', '16384'])  # fmt: skip
    jobs = long_context.gpu405_jobs(tmp_path)
    assert [seq for seq in long_context.SEQUENCES] == [8192 * 2**k for k in range(5)]
    for seq, (name, command, path) in zip(long_context.SEQUENCES, jobs):
        assert command[command.index('--target') + 1] == 'h100-80gb', command
        assert command[command.index('--json') + 1] == str(path), command
        config = _resolved(command)
        mesh = config.mesh
        layout = (mesh.tensor, mesh.stage, mesh.context, mesh.data)
        assert layout == (8, 16, seq // 8192, 128 * 8192 // seq), (name, layout)
        assert config.model.seq_len == seq
        assert config.train.global_batch * seq == 128 * 131072, name  # 16 M tokens a step
        assert config.train.micro_steps == 16, name
        assert config.train.pgle_profile_steps == 0, name  # XLA's own estimate, as the 8B
        for key in UNCHANGED:
            assert _key(config, key) == _key(reference, key), (name, key)
    assert _key(reference, 'model.rope_scaling'), 'Llama 3.1 scaling expected on'


def _plan(peak_gib, lockstep):
    """The fields of a 405B plan JSON that the table reads."""
    over = dict(exposed_vs_compute=0.128, step_s=7.068, lockstep=lockstep and dict(step_s=8.992))
    compiled = dict(peak_bytes=peak_gib * GIB, flops_vs_model=0.87, overlap=over,
                    attention=dict(kernels={'flash_dq': 64, 'flash_forward': 64}))  # fmt: skip
    cluster = dict(hbm_bytes=80e9, predicted_step_s=10.84, predicted_mfu=0.543,
                   peak_tflops=989.0)  # fmt: skip
    return dict(config=dict(global_batch=128), compiled=compiled, cluster=cluster,
                per_device_bytes=dict(total=76.5 * GIB))  # fmt: skip


def test_the_405b_table_reads_each_plan_and_a_failed_compile_is_a_row(
    tmp_path, monkeypatch, capsys
):
    seen = []

    def compile_stub(command):
        seq = int(command[command.index('--json') + 1].split('_')[-1].split('.')[0])
        seen.append(seq)
        if seq == 16384:
            return subprocess.CompletedProcess(command, 1, '', 'compiling ...\n' + CAUSE + '\n')
        plan = _plan(90.0 if seq == 8192 else 71.4, lockstep=seq != 65536)
        plan['config']['global_batch'] = 128 * 131072 // seq
        with open(command[command.index('--json') + 1], 'w') as f:
            json.dump(plan, f)
        return subprocess.CompletedProcess(command, 0, '', '')

    status = support.bench_with_stubbed_compiles(
        long_context, monkeypatch, compile_stub, '--results', tmp_path, '--only', 'gpu405'
    )
    assert status == '1 of 5 compiles failed: llama3_405b seq 16384', status
    assert seen == list(long_context.SEQUENCES)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith('| sequence'))
    assert len(header.split(' | ')) == len(long_context.GPU405_HEADER)
    rows = [line.strip('| ').split(' | ') for line in lines if line[2:3].isdigit()]
    assert [row[:2] for row in rows] == [
        ['8192', '1 x 128'], ['16384', '2 x 64'], ['32768', '4 x 32'], ['65536', '8 x 16'],
        ['131072', '16 x 8'],
    ]  # fmt: skip
    short, failed, full = rows[0], rows[1], rows[4]
    assert short[2:4] == ['90.0', 'NO (planned 76.5 GiB)'], short  # 96.6 GB > 80 GB
    assert failed[2] == f'failed: {CAUSE}' and set(failed[3:]) == {'-'}, failed
    assert len(failed) == len(full) == len(long_context.GPU405_HEADER), (failed, full)
    assert full[2:] == ['71.4', 'yes', '0.870', 'flash_dq 64, flash_forward 64', '12.8 %',
                        '7.068', '8.992', '0.421', '10.840', '54.3 % (537)'], full  # fmt: skip
    assert rows[3][8] == '-', rows[3]  # no lockstep figure: '-'
