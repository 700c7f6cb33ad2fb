"""No large copy inside the train step's loops, read from the XLA:GPU compile (compile-only
A100s, plan/gpu_target.py) with the plan's own reader (plan/loop_copies.py). A copy of the
pipeline's fp32 accumulators or stashes inside its scan runs every tick: on the 530 B layout
terabytes a step. Skipped without the gpu-compile compiler (make gpu-compile)."""

import pytest

import support
from mtnlg_jax.xla import gpu_compile
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import gpu_target
from mtnlg_jax.plan.loop_copies import loop_copies

pytestmark = pytest.mark.skipif(
    gpu_compile.missing() is not None, reason=str(gpu_compile.missing())
)
MIB = 1 << 20


@pytest.mark.parametrize(
    'schedule,repeats,dtype',
    [('1f1b', 1, 'float32'), ('interleaved', 2, 'bfloat16'), ('gpipe', 2, 'float32')],
)
def test_no_copy_over_a_mib_inside_a_loop(schedule, repeats, dtype):
    """Hidden 512: a layer's fp32 accumulators are 12 MiB, its bf16 weights 6 MiB."""
    config = support.small_config(
        stage=2, repeats=repeats, schedule=schedule, micro_steps=4, num_layers=4,
        hidden=512, compute_dtype=dtype, remat='selective',
    )  # fmt: skip
    devices = gpu_target.devices('a100-80gb', 2)
    with gpu_target.compiling_for(devices):
        compiled, _, _ = compile_lib.compile_train_step(config, devices=devices)
    copies = loop_copies(compiled.as_text(), min_bytes=MIB)
    assert not copies, [(c['type'], c['computation']) for c in copies]
