"""bench/gpu_check.py on a machine without a GPU: one error line and exit 2, nothing written;
its report keeps every section as it finishes (a run cut off keeps what it measured), a failed
section records its error and the next one runs, and the markdown holds the same figures."""

import json
import subprocess
import sys

import pytest

import support

sys.path.insert(0, str(support.ROOT / 'bench'))
import gpu_check  # noqa: E402


def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / 'check'
    result = subprocess.run(
        [sys.executable, str(support.ROOT / 'bench/gpu_check.py'), '--out', str(out)],
        capture_output=True, text=True, cwd=support.ROOT,
        env=dict(support.TRAIN_ENV, JAX_PLATFORMS='cpu'), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: no GPU'), result.stderr
    assert 'cpu' in lines[0] and result.stdout == ''
    assert not out.exists()


def test_the_report_keeps_each_section_as_it_finishes(tmp_path):
    report = gpu_check.Report(tmp_path, 'python bench/gpu_check.py')
    speeds = [dict(kind='flash', head_dim=160, fwd_bwd_ms=1.5), dict(kind='cudnn', head_dim=64)]
    report.run('kernel_speed', lambda: dict(shape='seq 2048', rows=speeds))

    def cut_off():
        written = json.loads((tmp_path / 'gpu_check.json').read_text())
        assert written['sections']['kernel_speed']['rows'] == speeds  # already on disk
        raise RuntimeError('out of memory\nsecond line')

    report.run('train_step', cut_off)
    report.run('hlo', lambda: dict(loop_copies_over_1_mib=0))
    sections = json.loads((tmp_path / 'gpu_check.json').read_text())['sections']
    assert list(sections) == ['kernel_speed', 'train_step', 'hlo']
    assert sections['train_step']['status'] == 'failed'
    assert sections['train_step']['error'] == 'RuntimeError: out of memory'
    assert sections['hlo']['status'] == 'ok' and sections['hlo']['loop_copies_over_1_mib'] == 0
    text = (tmp_path / 'gpu_check.md').read_text()
    assert '| kind | head_dim | fwd_bwd_ms |' in text
    assert '| flash | 160 | 1.5 |' in text and '| cudnn | 64 |  |' in text
    assert '| error | RuntimeError: out of memory |' in text
    assert not list(tmp_path.glob('*.partial'))


@pytest.mark.parametrize(
    'name, kind',
    [
        ('flash_attention_dkv', 'attention'),
        ('sm90_xmma_gemm_bf16bf16_bf16f32', 'matmuls'),
        ('nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NTT', 'matmuls'),  # cuBLAS 13 on Hopper
        ('loop_dynamic_update_slice_fusion_3', 'slicing'),
        ('wrapped_copy_2', 'copies'),
        ('input_transpose_fusion', 'transposes'),
        ('ncclDevKernel_AllReduce_Sum_bf16', 'collectives'),
        ('loop_add_fusion_12', 'elementwise'),
    ],
)
def test_profiled_kernels_are_split_by_kind(name, kind):
    pytest.importorskip('flax')
    import gpu_check_train  # noqa: PLC0415

    assert gpu_check_train.kind_of(name) == kind


SLOT_WRITE = """HloModule scheduled, is_scheduled=true, num_partitions=1

%fused_dot (a: f32[100,100], b: f32[100,100]) -> f32[100,100] {
  %a = f32[100,100]{1,0} parameter(0)
  %b = f32[100,100]{1,0} parameter(1)
  ROOT %d = f32[100,100]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_write (buffer: f32[8,100], row: f32[1,100], i: s32[]) -> f32[8,100] {
  %buffer = f32[8,100]{1,0} parameter(0)
  %row = f32[1,100]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %sum = f32[1,100]{1,0} add(%row, %row)
  ROOT %write = f32[8,100]{1,0} dynamic-update-slice(%buffer, %sum, %i, %zero)
}

ENTRY %m (w: f32[100,100], b: f32[8,100], r: f32[1,100], i: s32[]) -> (f32[100,100], f32[8,100]) {
  %w = f32[100,100]{1,0} parameter(0)
  %b = f32[8,100]{1,0} parameter(1)
  %r = f32[1,100]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %gemm.1 = f32[100,100]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %loop_add_fusion.2 = f32[8,100]{1,0} fusion(%b, %r, %i), kind=kLoop, calls=%fused_write
  ROOT %out = (f32[100,100]{1,0}, f32[8,100]{1,0}) tuple(%gemm.1, %loop_add_fusion.2)
}
"""


def test_profiled_kernels_split_as_the_replay_splits_its_instructions():
    """A kernel named after a fusion of the compiled module counts as the replay counts the
    fusion (this slot write's name reads as elementwise, its root is a dynamic-update-slice),
    the others by their names."""
    pytest.importorskip('flax')
    import gpu_check_train  # noqa: PLC0415

    from mtnlg_jax.plan import overlap  # noqa: PLC0415

    target = overlap.Target(1e12, 1e9, 1e6, 1e5, gpus_per_node=2)
    replay = overlap.collective_overlap(SLOT_WRITE, dict(data=1, stage=1, tensor=1), target)
    kinds = gpu_check_train.replay_kinds(replay['replay'])
    assert gpu_check_train.kind_of('loop_add_fusion_2') == 'elementwise'
    measured = {'loop_add_fusion_2': 1.0, 'gemm_1': 2.0, 'nvjet_sm90_tst_NTT': 4.0,
                'flash_attention_dq': 8.0, 'MemcpyD2D': 16.0}  # fmt: skip
    assert gpu_check_train.by_replay_kind(measured, kinds) == {
        'slicing and slot writes': 1.0, 'matmuls': 6.0, 'attention kernels': 8.0, 'copies': 16.0
    }  # fmt: skip


def test_the_matmul_sections_check_the_kernels_against_their_references():
    # Interpreted on the CPU at small shapes: the agreement is the GPU check's own measure,
    # and a kernel broken on purpose would fail it.
    pytest.importorskip('flax')
    import gpu_check_matmuls  # noqa: PLC0415

    moe = gpu_check_matmuls.grouped_matmul(
        shapes=((8, 2),), tokens=128, hidden=32, ffn=64, block=16, ways=('grouped', 'padded'),
        agreement_shape=(128, 32, 64, 16),
    )  # fmt: skip
    assert moe['agreement']['agrees'], moe['agreement']
    assert [row['way'] for row in moe['rows']] == ['grouped', 'padded']
    assert all('error' not in row for row in moe['rows']), moe['rows']
    assert moe['rows'][1]['compiled_vs_active'] == 1.0
    rows = gpu_check_matmuls.fp8_matmuls(shapes=(('mlp in', 64, 128, 256),))['rows']
    fp8 = {row['recipe']: row for row in rows}
    assert list(fp8) == ['bf16', 'tensorwise', 'delayed', 'blockwise']
    assert fp8['bf16']['out'] < 0.01 < fp8['tensorwise']['out'] < 0.1
    assert all(0.01 < fp8[recipe][leaf] < 0.1 for recipe in list(fp8)[1:] for leaf in ('out', 'dx'))


def test_the_fp8_train_rows_give_each_recipes_losses_beside_bf16s():
    # The check's train step at a tiny width on the CPU (XLA:CPU runs FP8 by widening): every
    # recipe trains from bf16's first loss within FP8's error, and the rows say so.
    pytest.importorskip('flax')
    import gpu_check_train  # noqa: PLC0415

    tiny = dict(num_layers=1, hidden=128, heads=1, seq_len=128, vocab_size=512)
    rows = {row['recipe']: row for row in gpu_check_train.fp8_train(steps=2, **tiny)['rows']}
    assert list(rows) == ['none', 'tensorwise', 'delayed', 'blockwise']
    assert all('error' not in row and len(row['losses']) == 2 for row in rows.values()), rows
    for recipe in ('tensorwise', 'delayed', 'blockwise'):
        assert 0 < abs(rows[recipe]['first_loss_vs_bf16']) < 0.01, rows[recipe]


def test_the_collectives_section_checks_each_exchange_and_needs_a_peer():
    # On the 8 simulated devices: each collective's result against numpy's (an all-to-all
    # that returned its input unchanged, or a reduce-scatter that did not sum, would fail).
    pytest.importorskip('jax')
    import jax  # noqa: PLC0415

    import gpu_check_collectives  # noqa: PLC0415

    kinds = ('all_to_all', 'all_gather', 'reduce_scatter')
    result = gpu_check_collectives.collectives(sizes_mib=(1,), kinds=kinds)
    assert [row['collective'] for row in result['rows']] == list(kinds)
    assert all(row['agrees'] and row['ms'] > 0 for row in result['rows']), result['rows']
    assert result['rows'][0]['mib'] == 1.0
    one = gpu_check_collectives.collectives(devices=jax.local_devices()[:1])
    assert one == dict(skipped='needs two or more GPUs: 1 here', rows=[])
