"""lm-evaluation-harness on a workdir's checkpoint: the harness's own command line, our model.

    python launch/harness.py --workdir runs/tiny --tasks mtnlg_lambada_local,mtnlg_choice_local \
        --include_path harness_tasks [any other lm_eval flag: --num_fewshot 1 --limit 100
        --output_path results/ --log_samples --batch_size 16 ...]

Our flags (--workdir, --step, --data_parallel, --tensor, --expert, --tokenizer,
--max_gen_toks) become `--model mtnlg_jax --model_args ...` (mtnlg_jax/eval/harness.py);
--only_include_path skips indexing the harness's built-in tasks (tens of seconds); everything
else goes to lm_eval's `run` unchanged (--batch_size, rows per model call, defaults to 8 here
instead of 1).
Nothing is downloaded: the harness and Hugging Face datasets run offline (HF_DATASETS_OFFLINE,
HF_HUB_OFFLINE), so tasks must read local files, as harness_tasks/*.yaml do
(`dataset_path: json` with `data_files`). From Python:
`import mtnlg_jax.eval.harness` registers the model for `lm_eval.simple_evaluate(
model='mtnlg_jax', model_args='workdir=W')`. Bad input of our flags or the workdir prints one
line `error: ...` and exits with status 2 before anything is compiled.
"""

import argparse
import functools
import os
import sys

from mtnlg_jax.run.cli import ArgumentParser, check_output, cpu_devices, fail, workdir_config

OUR_FLAGS = ('step', 'data_parallel', 'tensor', 'expert', 'tokenizer', 'max_gen_toks')
MODEL_ARG_NAMES = dict(data_parallel='data')  # our flag -> the model class's argument
DEFAULT_BATCH_SIZE = 8  # rows per model call unless lm_eval's --batch_size says otherwise


def parse_args(argv):
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, add_help=False
    )
    parser.add_argument('--workdir', required=True, help='a run of launch/train.py')
    parser.add_argument('--step', type=int, help='checkpoint step (default: the newest)')
    parser.add_argument('--data_parallel', type=int, help='mesh data size (default: the run)')
    parser.add_argument('--tensor', type=int, help='mesh tensor size (default: the run)')
    parser.add_argument(
        '--expert',
        type=int,
        help="mesh expert size: an MoE's experts split over it, the batch too (default 1)",
    )
    parser.add_argument('--tokenizer', help="tokenizer files (default: the run's)")
    parser.add_argument('--max_gen_toks', type=int, help='generate_until default (256)')
    parser.add_argument(
        '--only_include_path',
        action='store_true',
        help="index only --include_path's tasks, not the harness's own thousands (faster)",
    )
    if '-h' in argv or '--help' in argv:
        parser.print_help()
        print('\nEvery other flag is lm_eval run\'s: see `lm_eval run --help`.')
        sys.exit(0)
    return parser.parse_known_args(argv)


def model_args(args):
    """The model_args string of our flags (commas cannot appear in paths here)."""
    pairs = [('workdir', os.path.abspath(args.workdir))]
    for flag in OUR_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            pairs.append((MODEL_ARG_NAMES.get(flag, flag), value))
    for name, value in pairs:
        if ',' in str(value) or '=' in str(value):
            fail(f'--{name} {value}: lm_eval model_args cannot hold "," or "="')
    return ','.join(f'{name}={value}' for name, value in pairs)


def check(args):
    """The workdir, mesh and tokenizer, read and checked before lm_eval starts."""
    for name in ('data_parallel', 'tensor', 'expert', 'max_gen_toks'):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f'--{name} must be a positive integer, got {value}')
    run_mesh = workdir_config(args.workdir)['mesh']  # without JAX: then its CPU devices
    expert = args.expert or 1
    cpu_devices(
        (args.data_parallel or run_mesh['data']) * (args.tensor or run_mesh['tensor']) * expert
    )

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.eval import workdir as workdir_lib

    try:
        saved = workdir_lib.read_saved_config(args.workdir)
        config = workdir_lib.inference_config(saved, args.data_parallel, args.tensor, expert=expert)
        workdir_lib.run_tokenizer(args.workdir, config, args.tokenizer)
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))


def main(argv):
    args, harness_args = parse_args(argv)
    if any(a == '--model' or a.startswith(('--model=', '--model_args')) for a in harness_args):
        fail('--model and --model_args are set by launch/harness.py from --workdir and its flags')
    if not any(a == '--tasks' or a.startswith('--tasks=') for a in harness_args):
        fail('--tasks is required (e.g. --tasks mtnlg_choice_local --include_path harness_tasks)')
    for index, arg in enumerate(harness_args[:-1]):
        path = harness_args[index + 1]
        if arg == '--include_path' and not os.path.isdir(path) and not os.path.isfile(path):
            fail(f'--include_path {path}: no such folder')
        if arg in ('--output_path', '-o'):  # lm_eval writes a .json file or into a folder
            check_output(path, arg, directory=not path.endswith('.json'))
    os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    # The harness bootstraps stderrs in a forked process pool unless told not to; forking a
    # process that runs JAX (multithreaded) can deadlock.
    os.environ.setdefault('DISABLE_MULTIPROC', '1')
    check(args)

    from lm_eval.__main__ import cli_evaluate

    import mtnlg_jax.eval.harness  # noqa: F401  (registers --model mtnlg_jax)

    if args.only_include_path:
        # lm_eval's command line has no switch for its TaskManager's include_defaults.
        from lm_eval.tasks import TaskManager

        TaskManager.__init__ = functools.partialmethod(TaskManager.__init__, include_defaults=False)

    if not any(a == '--batch_size' or a.startswith('--batch_size=') for a in harness_args):
        harness_args += ['--batch_size', str(DEFAULT_BATCH_SIZE)]  # lm_eval's default is 1
    sys.argv = [
        'lm_eval',
        'run',
        '--model',
        'mtnlg_jax',
        '--model_args',
        model_args(args),
        *harness_args,
    ]
    cli_evaluate()


if __name__ == '__main__':
    main(sys.argv[1:])
