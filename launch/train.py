"""Train a GPT from an ml_collections config.

    python launch/train.py --config configs/tiny.py --workdir runs/tiny [--config.KEY=VALUE ...]

Any config key can be overridden on the command line (`--config.mesh.tensor=4`). On a machine
without accelerators the CPU offers as many devices as the config's mesh asks for (unless
XLA_FLAGS already sets --xla_force_host_platform_device_count). Bad input (config, data,
tokenizer, workdir, flags) prints one line `error: ...` and exits with status 2 before anything
is compiled or written.

Re-running the same command on a workdir resumes its newest complete checkpoint, under this
command's layout; if the workdir is already at train.steps there is nothing to do (exit 0).
SIGTERM or SIGINT finishes the current step, saves and exits 0. What each failure looks like
and how to resume: docs/faults.md.

The same command runs as one of several processes (jax.distributed) under launch/spawn.py,
SLURM (launch/slurm/train.sbatch), Open MPI, or with --coordinator, --num_processes and
--process_id; process 0 prints and writes the run's outputs.
"""

import sys

from mtnlg_jax.run import cli, distributed
from mtnlg_jax.xla import flags as xla_flags
from mtnlg_jax.run.cli import fail
from mtnlg_jax.run.rundir import RunDir, RunDirError


def parse_args(argv):
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_config()
    parser.add_argument('--workdir', required=True, help='directory of the run (created)')
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


def check_tokenizer(config):
    """data.tokenizer must exist and match model.vocab_size ('' : a run of token ids only)."""
    from mtnlg_jax.data import tokenizer as tokenizer_lib

    if not config.data.tokenizer:
        return
    try:
        key = 'config key data.tokenizer:'
        tokenizer_lib.open_tokenizer(config.data.tokenizer, config.model, key)
    except tokenizer_lib.TokenizerError as e:
        fail(f'{e} (--config.data.tokenizer= trains on token ids with none)')


def changed_inputs(before, after, prefix=''):
    """['key: old -> new', ...] between two input dicts (a continued run says what changed)."""
    lines = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            lines += changed_inputs(old, new, f'{prefix}{key}.')
        elif old != new:
            lines.append(f'{prefix}{key}: {old!r} -> {new!r}')
    return lines


def main(argv):
    args = parse_args(argv)
    run_dir = RunDir(args.workdir)
    try:
        run_dir.check_writable()
    except RunDirError as e:
        fail(str(e))
    # Each process offers its share of the mesh's devices.
    cli.cpu_devices(
        max(1, cli.mesh_device_count(args.config.mesh) // distributed.requested_process_count(args))
    )
    # Before any JAX call; a bad command line has cost no JAX start-up.
    xla_flags.apply()  # the recommended XLA:GPU flags; XLA_FLAGS of the user's own win
    distributed.initialize_for_config(args.config, args)
    import jax

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.checkpoint.store import CheckpointError
    from mtnlg_jax.data.indexed import DataError
    from mtnlg_jax.train import faults, loop

    try:
        config = config_lib.resolve(args.config, jax.device_count())
    except config_lib.ConfigError as e:
        hint = ''
        if e.key == 'mesh' and jax.default_backend() == 'cpu' and jax.process_count() == 1:
            hint = ' (on CPU, leave XLA_FLAGS unset or set --xla_force_host_platform_device_count)'
        fail(f'{e}{hint}')
    steps = run_dir.saved_steps()
    if steps and steps[-1] >= config.train.steps:
        cli.nothing_to_do(
            f'nothing to do: {args.workdir} is at step {steps[-1]} and train.steps is '
            f'{config.train.steps} (raise --config.train.steps to train on)'
        )
    check_tokenizer(config)
    if run_dir.has_config():
        try:
            before = run_dir.read_inputs()
        except RunDirError as e:
            fail(str(e))
        changes = changed_inputs(before, config.inputs.to_dict())
        if distributed.is_primary():
            print(
                f'config       continues {run_dir.config_path}; '
                + (f'changed: {", ".join(changes)}' if changes else 'no input changed'),
                flush=True,
            )
    try:
        loop.train(config, args.workdir)
    except (DataError, CheckpointError, config_lib.ConfigError) as e:
        fail(str(e))
    except (faults.NonFiniteError, faults.SaveFailedError) as e:  # a run gone wrong: status 1
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)
    except jax.errors.JaxRuntimeError as e:
        distributed.exit_after_runtime_error(e)
        raise


if __name__ == '__main__':
    main(sys.argv[1:])
