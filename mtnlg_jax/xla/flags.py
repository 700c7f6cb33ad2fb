"""The XLA:GPU flags we recommend: one place, read before JAX starts.

launch/train.py applies them (they only concern XLA:GPU; XLA:CPU ignores them), and so does
the GPU-target compile of launch/plan.py, so what the planner measures is what trains. A flag
the user sets in their own XLA_FLAGS wins over ours, whatever its value:

    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false python launch/train.py ...

What each changed in the compiled 530 B step is in docs/scale.md ("XLA:GPU flags").
"""

import importlib.metadata
import os
import re
import subprocess
import sys

# The XLA:GPU option that reads a latency profile (ProfiledInstructionsProto, .pb binary or
# .pbtxt text): train/pgle.py's measured costs, plan/pgle.py's replayed ones.
PGLE_PROFILE_OPTION = 'xla_gpu_pgle_profile_file_or_directory_path'

# (flag, value, why). Each was compared on the GPU compile of the 530 B step, one at a time
# and together (docs/scale.md, "XLA:GPU flags"); the ones that did not help are not here.
RECOMMENDED_GPU_FLAGS = (
    (
        'xla_gpu_enable_latency_hiding_scheduler',
        'true',
        'schedules independent compute between the start and the done of each asynchronous '
        'collective',
    ),
    (
        'xla_gpu_enable_analytical_latency_estimator',
        'true',
        'the scheduler prices collectives and kernels with XLA\'s analytical model of the GPU '
        'instead of fixed guesses: it starts the sequence-parallel all-gathers earlier',
    ),
    (
        'xla_gpu_experimental_parallel_collective_overlap_limit',
        '4',
        'up to 4 asynchronous collectives in flight at once (default 1): a stage hand-off over '
        'the network no longer waits for a tensor collective over NVLink to finish',
    ),
    (
        'xla_gpu_enable_while_loop_double_buffering',
        'true',
        'unrolls loops by two so that the next iteration\'s collectives can start during this one',
    ),
    (
        'xla_gpu_enable_pipelined_all_gather',
        'true',
        'moves a loop\'s all-gathers into the iteration before the one that uses them',
    ),
    (
        'xla_gpu_enable_pipelined_reduce_scatter',
        'true',
        'moves a loop\'s reduce-scatters into the iteration after the one that makes them',
    ),
    (
        'xla_gpu_memory_limit_slop_factor',
        '400',
        'XLA:GPU\'s own count of memory before buffer assignment is far above what is allocated '
        '(the Llama 3 405B step: 157 GiB counted, 71 GiB allocated), so at its default (95 % of '
        'the device) its rematerialization pass recomputes behind model.remat\'s back and its '
        'scheduler runs collectives unhidden to save memory; the real peak is checked by '
        'launch/plan.py --compile (memory_analysis)',
    ),
)

# The jaxlib the flags above were compared on (requirements.txt). XLA aborts a process whose
# XLA_FLAGS names a flag it does not know, and flags come and go between releases: under any
# other jaxlib, apply() asks a child process first and leaves out the ones it refuses.
VERIFIED_JAXLIB = '0.10.2'
# Flags applied under VERIFIED_JAXLIB alone: XLA of another jaxlib was seen failing with them.
ONLY_ON_VERIFIED = {
    'xla_gpu_enable_analytical_latency_estimator': 'XLA of jaxlib 0.11.2 aborts compiling a '
    'one-GPU train step with it (a failed check in CalculateLaunchDimensions under '
    'AnalyticalLatencyEstimator::NodeCost; make gpu-check on an H200, docs/benchmarks.md)',
}

_FLAG_NAME = re.compile(r'--([A-Za-z0-9_]+)')


def user_flag_names(xla_flags_value):
    """Names of the flags in an XLA_FLAGS string."""
    return set(_FLAG_NAME.findall(xla_flags_value or ''))


def merged(xla_flags_value, recommended=RECOMMENDED_GPU_FLAGS):
    """(new XLA_FLAGS string, [(flag, value) applied]): the recommended flags the user did not
    set, then the user's own."""
    mine = user_flag_names(xla_flags_value)
    applied = [(flag, value) for flag, value, _ in recommended if flag not in mine]
    parts = [f'--{flag}={value}' for flag, value in applied]
    if xla_flags_value and xla_flags_value.strip():
        parts.append(xla_flags_value.strip())
    return ' '.join(parts), applied


def unknown_to_xla(xla_flags_value, python=sys.executable):
    """Names of the flags in an XLA_FLAGS string that this XLA refuses: a child process on
    the CPU (about a second) reads them, as XLA:GPU would, and names them as it aborts."""
    environ = {**os.environ, 'XLA_FLAGS': xla_flags_value, 'JAX_PLATFORMS': 'cpu'}
    child = subprocess.run([python, '-c', 'import jax; jax.devices()'], env=environ,
                           capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    refused = [line for line in child.stderr.splitlines() if 'Unknown flag' in line]
    return user_flag_names(' '.join(refused))


def _installed_jaxlib():
    try:
        return importlib.metadata.version('jaxlib')
    except importlib.metadata.PackageNotFoundError:
        return None


def apply(environ=os.environ, jaxlib=None):
    """Put the recommended flags into environ['XLA_FLAGS'] (before JAX is imported); returns
    the (flag, value) pairs applied, for the banner. Under a jaxlib other than
    VERIFIED_JAXLIB, the ones this XLA does not know and ONLY_ON_VERIFIED are left out."""
    recommended = RECOMMENDED_GPU_FLAGS
    if (jaxlib or _installed_jaxlib()) not in (VERIFIED_JAXLIB, None):
        value, applied = merged('', recommended)
        unknown = (unknown_to_xla(value) if applied else set()) | set(ONLY_ON_VERIFIED)
        recommended = tuple(row for row in recommended if row[0] not in unknown)
    value, applied = merged(environ.get('XLA_FLAGS', ''), recommended)
    if value:
        environ['XLA_FLAGS'] = value
    return applied


def left_out(environ=os.environ):
    """The recommended flags neither in effect nor set by the user: the ones apply() left
    out under this jaxlib."""
    named = user_flag_names(environ.get('XLA_FLAGS', ''))
    return [flag for flag, _, _ in RECOMMENDED_GPU_FLAGS if flag not in named]


def in_effect(environ=os.environ):
    """[(flag, value, 'ours' | 'XLA_FLAGS')] of the recommended flags as XLA will read them:
    the last value the XLA_FLAGS string gives each."""
    text = environ.get('XLA_FLAGS', '')
    ours = {f'--{flag}={value}' for flag, value, _ in RECOMMENDED_GPU_FLAGS}
    out = []
    for flag, _, _ in RECOMMENDED_GPU_FLAGS:
        found = re.findall(rf'--{flag}=(\S+)', text)
        if found:
            source = 'ours' if f'--{flag}={found[-1]}' in ours else 'XLA_FLAGS'
            out.append((flag, found[-1], source))
    return out


def describe(environ=os.environ):
    """The banner's line: the recommended flags in effect and where each value comes from."""
    flags = in_effect(environ)
    if not flags:
        return 'none of ours'
    return ' '.join(
        f'--{flag}={value}' + ('' if source == 'ours' else ' (your XLA_FLAGS)')
        for flag, value, source in flags
    )
