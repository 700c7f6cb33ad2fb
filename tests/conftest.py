"""Every test runs on a CPU with 8 simulated devices, set before JAX is imported."""

import atexit
import os
import shutil
import tempfile


def _kernel_cache_flags():
    """XLA:GPU's compiles (test_gpu_compile.py, test_loop_copies.py, ...): one file of the
    kernels they assembled, a test process's and the tools' it starts (one at a time), so a
    kernel another compile made (a GEMM of the same shapes, a like fusion) is not lowered
    and assembled (ptxas: half a compile's CPU) again. The HLO the tests read is optimized
    before any kernel is made; test_loop_copies.py 79.9 -> 68.6 CPU-s (docs/benchmarks.md,
    "The test suite's time"). XLA:CPU ignores both."""
    folder = tempfile.mkdtemp(prefix='mtnlg_jax_test_gpu_kernels_')
    atexit.register(shutil.rmtree, folder, True)
    return (
        f' --xla_gpu_kernel_cache_file={folder}/kernels'
        ' --xla_gpu_enable_llvm_module_compilation_parallelism=true'  # the cache's unit
    )


# Compiling dominates these small models' tests: a cheaper LLVM backend halves it, XLA:CPU's
# older loop emitters instead of its MLIR fusion emitters halve it again, and one LLVM module
# a program instead of 32 compiled in parallel saves a tenth more on 2 cores (tests compare
# numbers computed under the same flags, so nothing they check depends on these).
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '')
    + ' --xla_force_host_platform_device_count=8'
    + ' --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
    + ' --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1'
    + _kernel_cache_flags()
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# No Python stack (up to 100 frames) in every op's location: lowering and compiling carry
# it through every pass into the HLO's metadata (stack_frame_id), where nothing reads it;
# the op names the HLO tests read are the same (docs/benchmarks.md, "The test suite's time").
os.environ.setdefault('JAX_TRACEBACK_IN_LOCATIONS_LIMIT', '0')
# For the XLA:GPU compiles of test_gpu_compile.py, after `make gpu-compile`: the compiler on
# this process's path (not on its subprocesses'), no driver to check CUDA against, and the
# XLA:GPU flags launch/plan.py --target compiles with (XLA:CPU ignores them).
from mtnlg_jax.xla import gpu_compile  # noqa: E402 (no JAX)

gpu_compile.prepare_environment()


import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Python's cycle collector at its default thresholds took 3.2 of test_side_values.py's 48
# CPU-s and 3.6 of test_unequal_stages.py's 70, most of it in full collections walking every
# object that imports, tracing and compiling left alive; collected 14 times less often, with
# the imports' objects frozen out of its walks once collection has imported them, 0.9 s each
# (refcounting still frees at once what no cycle holds; docs/benchmarks.md, "The test suite's
# time").
gc.set_threshold(10_000, 10, 10)
# The same in every Python the tests start (tests/startup/sitecustomize.py).
os.environ['PYTHONPATH'] = os.pathsep.join(
    filter(None, [os.path.join(os.path.dirname(__file__), 'startup'), os.environ.get('PYTHONPATH')])
)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.fixture(scope='module')
def token_data(tmp_path_factory):
    """Prefix of a small learnable indexed dataset: 220 documents of one pattern of ids < 300."""
    from mtnlg_jax.data.indexed import IndexedDatasetWriter

    prefix = str(tmp_path_factory.mktemp('data') / 'pattern')
    pattern = np.random.default_rng(0).integers(0, 300, 97)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(220):
        writer.add(pattern)
    writer.finish()
    return prefix
