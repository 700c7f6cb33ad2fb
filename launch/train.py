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

from mtnlg_jax.run import cli, distributed, rundir
from mtnlg_jax.xla import flags as xla_flags
from mtnlg_jax.run.cli import fail
from mtnlg_jax.run.rundir import RunDir, RunDirError


def parse_args(argv):
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_config()
    parser.add_argument('--workdir', required=True, help='directory of the run (created)')
    parser.add_argument(
        '--accept_changes',
        action='store_true',
        help='continue the workdir with another recipe or data stream (docs/checkpoints.md)',
    )
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


def run_identity(config):
    """identity.json's record of this run (data/identity.py's run_record); fail() on data
    that cannot be read or whose tokenizers disagree with data.tokenizer or each other."""
    from mtnlg_jax.data import identity
    from mtnlg_jax.data.indexed import DataError

    try:
        return identity.run_record(config)
    except DataError as e:
        fail(str(e))


def warn_unchecked(record):
    """Once every check has passed: a warning per source whose files name no tokenizer."""
    from mtnlg_jax.data import identity

    for source in record['data']['sources']:
        if source['tokenizer'] is None:
            identity.warn_once(source['prefix'])


def check_continuation(args, run_dir, config, now):
    """The identity to record when this command continues run_dir: what changed is printed;
    a change the key table's resume column (config/keys.py) calls never is refused, one it
    calls explicit (or another data stream) is refused without --accept_changes. The rules
    hold once the workdir has a checkpoint of a run that recorded its identity (not an
    import, not a run from before)."""
    from mtnlg_jax.config import keys
    from mtnlg_jax.data import identity

    try:
        before, recorded = run_dir.read_inputs(), run_dir.read_identity()
    except RunDirError as e:
        fail(str(e))
    changes = rundir.changed_inputs(before, config.inputs.to_dict())
    if distributed.is_primary():
        listed = ', '.join(f'{key}: {old!r} -> {new!r}' for key, old, new in changes)
        print(
            f'config       continues {run_dir.config_path}; '
            + (f'changed: {listed}' if changes else 'no input changed'),
            flush=True,
        )
    steps = run_dir.saved_steps()
    if not (recorded and steps):
        return now
    refused, asked = [], []
    then_tokenizer, tokenizer = recorded.get('tokenizer'), now['tokenizer']
    if then_tokenizer and not (tokenizer and identity.same(then_tokenizer, tokenizer)):
        new = identity.describe(tokenizer) if tokenizer else 'none known (data.tokenizer empty)'
        refused.append(f'the tokenizer {identity.describe(then_tokenizer)} -> {new}')
    for key, old, new in changes:
        rule = keys.BY_NAME[key].resume if key in keys.BY_NAME else 'explicit'
        if key != 'data.tokenizer' and rule != 'free':  # the tokenizer: by identity, above
            (refused if rule == 'never' else asked).append(f'{key}: {old!r} -> {new!r}')
    asked += identity.stream_changes(recorded.get('data', {}), now['data'])
    if refused:
        fail(
            f'--workdir {args.workdir} cannot continue with {"; ".join(refused)}: a run keeps '
            'its model and tokenizer (docs/checkpoints.md; a new workdir with '
            f'--config.checkpoint.init_from={args.workdir} starts from its parameters)'
        )
    if asked and not args.accept_changes:
        fail(
            f'--workdir {args.workdir} would continue with another data stream: '
            f'{"; ".join(asked)} (give the run\'s own values, or --accept_changes to continue '
            'with these: docs/checkpoints.md)'
        )
    history = recorded.get('changes', [])
    return dict(now, changes=history + [dict(after_step=steps[-1], changed=asked)] * bool(asked))


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
    from mtnlg_jax.run.storage import StorageError
    from mtnlg_jax.train import faults
    from mtnlg_jax.xla import options as xla_options

    try:
        config = config_lib.resolve(args.config, jax.device_count())
    except config_lib.ConfigError as e:
        hint = ''
        if e.key == 'mesh' and jax.default_backend() == 'cpu' and jax.process_count() == 1:
            hint = ' (on CPU, leave XLA_FLAGS unset or set --xla_force_host_platform_device_count)'
        fail(f'{e}{hint}')
    why = xla_options.refused(config_lib.xla_options(config.train))
    if why:
        fail(why)
    steps = run_dir.saved_steps()
    if steps and steps[-1] >= config.train.steps:
        cli.nothing_to_do(
            f'nothing to do: {args.workdir} is at step {steps[-1]} and train.steps is '
            f'{config.train.steps} (raise --config.train.steps to train on)'
        )
    check_tokenizer(config)
    record = run_identity(config)
    if run_dir.has_config():
        record = check_continuation(args, run_dir, config, record)
    warn_unchecked(record)
    from mtnlg_jax.train import loop  # the model and its step: 0.4 CPU-s no refusal needs

    try:
        loop.train(config, args.workdir, identity=record)
    except (DataError, CheckpointError, config_lib.ConfigError) as e:
        fail(str(e))
    except (faults.NonFiniteError, faults.SaveFailedError, StorageError) as e:  # status 1
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)
    except jax.errors.JaxRuntimeError as e:
        distributed.exit_after_runtime_error(e)
        raise


if __name__ == '__main__':
    main(sys.argv[1:])
