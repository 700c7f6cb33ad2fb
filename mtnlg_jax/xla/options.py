"""A config's own XLA options (train.xla_options), checked before the step compiles.

XLA reads compiler options only when it compiles, and a name it does not know or a value it
cannot parse fails there: minutes into the 405B's compile. `refused` has a child process on
the CPU compile a one-line program with them first (about a second, as flags.unknown_to_xla
asks about XLA_FLAGS), so that a bad option is one line before any compile of the caller's.
"""

import json
import os
import subprocess
import sys

_PROBE = """
import json, sys
import jax
one = jax.ShapeDtypeStruct((), 'float32')
try:
    jax.jit(lambda x: x + 1).lower(one).compile(json.loads(sys.argv[1]))
except jax.errors.JaxRuntimeError as e:
    print(str(e).splitlines()[0].removeprefix('INVALID_ARGUMENT: '))
"""


def refused(options, python=sys.executable):
    """None if XLA takes every option of `options` ({name: value}), else the error line
    naming the key and XLA's reason."""
    reason = _reason(options, python)
    return reason and f'config key train.xla_options: XLA does not take them: {reason}'


def _reason(options, python):
    if not options:
        return None
    environ = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    environ['JAX_PLATFORMS'] = 'cpu'
    child = subprocess.run([python, '-c', _PROBE, json.dumps(options)], env=environ,
                           capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    if child.returncode:
        last = (child.stderr.strip().splitlines() or ['no output'])[-1]
        return f'the check of them failed: {last}'
    return child.stdout.strip() or None
