"""bench/scale.py when a compile fails: its row says so with launch/plan.py's error line, the
other compiles run and both tables are printed, and the benchmark exits 1. The compiles are
stubbed (no JAX, no compile): each writes a plan of the fields the tables read, or fails."""

import json
import subprocess
import sys

import support

sys.path.insert(0, str(support.ROOT / 'bench'))
import scale  # noqa: E402

CAUSE = (
    "error: XLA:GPU could not compile this step for h100-80gb: INTERNAL: Couldn't find output "
    'tile sizes that satisfy hlo: %dot.242 = f32[2560,20480]{1,0} dot(...)'
)
MESH = dict(data=8, stage=35, tensor=8)
GB = 1e9


def a_plan(peak_gb):
    """The fields of a plan JSON that the scale tables read."""
    comm = {'all-reduce': {'tensor': 64 * GB}}
    compiled = dict(
        config=dict(mesh=MESH, micro_steps=240), planned_as_compiled=dict(
            per_device_bytes=dict(total=30 * GB), comm_bytes_per_device=comm),
        peak_bytes=peak_gb * GB, comm_bytes_per_device=comm, flops_vs_model=1.0, compile_s=60,
        devices=2240, attention=dict(fused=True),
        overlap=dict(compute_s=7.7, exposed_s=1.2, exposed_vs_compute=0.159),
    )  # fmt: skip
    return dict(params=530e9, config=dict(mesh=MESH, micro_steps=240), compiled=compiled,
                per_device_bytes=dict(total=30 * GB))  # fmt: skip


def test_a_failed_compile_is_a_row_of_its_cause_and_the_tables_are_printed(
    tmp_path, monkeypatch, capsys
):
    def compile_stub(command):
        path = command[command.index('--json') + 1]
        if 'h100-80gb' in command:
            return subprocess.CompletedProcess(command, 1, '', 'compiling ...\n' + CAUSE + '\n')
        with open(path, 'w') as f:
            json.dump(a_plan(30.3), f)
        return subprocess.CompletedProcess(command, 0, '', '')

    status = support.bench_with_stubbed_compiles(
        scale, monkeypatch, compile_stub, '--results', tmp_path, '--only', 'mtnlg_530b'
    )
    assert 'mtnlg_530b h100-80gb' in str(status), status  # status 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith('| mtnlg')]
    assert len(rows) == 3, rows  # XLA:CPU's, then A100's and H100's
    cpu, a100, h100 = (line.split(' | ') for line in rows)
    assert cpu[6] == '30.3' and a100[1] == 'a100-80gb' and a100[5] == '30.3', rows
    assert h100[1] == 'h100-80gb' and h100[2] == f'failed: {CAUSE}', h100
    assert set(h100[3:-1]) == {'-'} and len(h100) == len(a100), h100
