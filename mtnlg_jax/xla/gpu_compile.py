"""The XLA:GPU compiler on a machine without a GPU, made ready before JAX starts.

    make gpu-compile   ->  .gpu-compile/ (requirements-gpu-compile.txt: the jax-cuda12 plugin
                           matching jax 0.10.2, and cuDNN + cuBLAS, which JAX checks for while
                           tracing the fused attention kernel; about 2.3 GB)
    enable()           ->  that folder on sys.path, before JAX is imported
    prepare_environment()  the runtime stays on the CPU (JAX_PLATFORMS=cpu), the plugin's check
                           of CUDA against a driver is skipped (there is none), and the
                           recommended XLA:GPU flags are set (mtnlg_jax/xla/flags.py)

Why a folder of its own and not the project's virtual environment: once the plugin can be
imported, every JAX start on a machine without a CUDA driver prints 'Could not find cuda
drivers' lines that no log level silences, and every tool's one-line error would become ten.
Only the processes that compile for a GPU (launch/plan.py --target, the test session) put it on
their path. A plugin installed in the environment itself (pip install jax-cuda12-plugin) is used
as well.

plan/gpu_target.py makes the compile-only devices; its target names are the cluster names of
plan/clusters.py, one vocabulary.
"""

import contextlib
import importlib.util
import os
import pathlib
import re
import sys
import tempfile

from mtnlg_jax.xla import flags as xla_flags

TARGETS = ('a100-80gb', 'h100-80gb', 'h200-141gb')
COMPILER_DIR = pathlib.Path(
    os.environ.get(
        'MTNLG_GPU_COMPILE_DIR', pathlib.Path(__file__).resolve().parents[2] / '.gpu-compile'
    )
)
INSTALL = (
    'make gpu-compile (pip install --no-deps --target .gpu-compile -r requirements-gpu-compile.txt)'
)
# What it must bring: the XLA:GPU compiler (plugin + PJRT) and cuDNN.
REQUIRED_MODULES = (
    ('jax_plugins.xla_cuda12', 'jax-cuda12-plugin'),
    ('jax_cuda12_plugin', 'jax-cuda12-plugin'),
    ('nvidia.cudnn', 'nvidia-cudnn-cu12'),
)


def enable():
    """Put .gpu-compile/ on sys.path (once), before JAX is imported: JAX finds its plugins when
    it starts."""
    folder = str(COMPILER_DIR)
    if COMPILER_DIR.is_dir() and folder not in sys.path:
        sys.path.append(folder)


def missing():
    """None when the GPU compiler can be imported (after `enable`), else one sentence saying
    what to install."""
    enable()
    absent = sorted({package for module, package in REQUIRED_MODULES if not _importable(module)})
    if not absent:
        return None
    return f'the XLA:GPU compiler is not installed ({", ".join(absent)} missing): {INSTALL}'


def _importable(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is absent
        return False


def prepare_environment(environ=os.environ):
    """Before JAX is imported: the compiler on the path, CPU runtime, no driver check, the
    recommended XLA:GPU flags (the user's own XLA_FLAGS win). Returns the flags applied."""
    enable()
    environ['JAX_PLATFORMS'] = 'cpu'
    environ['JAX_SKIP_CUDA_CONSTRAINTS_CHECK'] = '1'
    return xla_flags.apply(environ)


# What the plugin's C++ side prints on a machine without a driver, before absl's logging is
# set up (so no log level hides it): true, and of no use to the reader.
_NO_DRIVER_NOISE = re.compile(
    r'cudart_stub\.cc.*Could not find cuda drivers|All log messages before absl::InitializeLog'
)


@contextlib.contextmanager
def without_driver_noise():
    """Run a block with the process's native stderr caught, then pass on every line of it but
    the plugin's 'no CUDA driver' notices."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode='w+b') as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors='replace').splitlines(keepends=True):
                if not _NO_DRIVER_NOISE.search(line):
                    sys.stderr.write(line)
            sys.stderr.flush()


def start_jax():
    """Import JAX after prepare_environment: the plugin loads then, and its no-driver notices
    are filtered out of stderr (later imports print nothing)."""
    with without_driver_noise():
        import jax  # noqa: F401, PLC0415
