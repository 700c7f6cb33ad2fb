"""Train a GPT from an ml_collections config.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python launch/train.py --config configs/tiny.py --workdir runs/tiny [--config.KEY=VALUE ...]

Any config key can be overridden on the command line (`--config.mesh.tensor=4`). Bad input
(config, data, flags) prints one line `error: ...` and exits with status 2 before anything is
compiled or written.

Re-running the same command on a workdir resumes its newest complete checkpoint, under this
command's layout. SIGTERM or SIGINT finishes the current step, saves and exits 0.
"""

import sys

from absl import flags
from ml_collections import config_flags

from mtnlg_jax.cli import fail

_CONFIG = config_flags.DEFINE_config_file('config', None, 'ml_collections config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory of the run.')


def main(argv):
    try:
        flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except (OSError, SyntaxError, AttributeError) as e:  # the config file could not be loaded
        fail(f'--config: {e}')
    if _CONFIG.value is None:
        fail('--config is required, e.g. --config configs/tiny.py')
    if not _WORKDIR.value:
        fail('--workdir is required')

    import jax  # after flag parsing: a bad command line costs no JAX start-up

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.checkpoint import CheckpointError
    from mtnlg_jax.data.indexed import DataError
    from mtnlg_jax.train import faults, loop

    try:
        config = config_lib.resolve(_CONFIG.value, jax.device_count())
    except config_lib.ConfigError as e:
        hint = ''
        if e.key == 'mesh' and jax.default_backend() == 'cpu':
            hint = ' (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=8)'
        fail(f'{e}{hint}')
    try:
        loop.train(config, _WORKDIR.value)
    except (DataError, CheckpointError) as e:
        fail(str(e))
    except faults.NonFiniteError as e:  # not bad input, a run that went wrong: status 1
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    main(sys.argv)
