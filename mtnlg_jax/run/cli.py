"""The command-line contract every launch script keeps (docs/cli.md).

    bad input     ->  one line `error: <what is wrong, naming the flag, key or file>`, exit 2,
                      before anything is compiled or written
    --help        ->  the tool's flags (and, for tools that take a config, its keys)
    nothing to do ->  one line saying so, exit 0

One flag dialect: argparse, `--snake_case` flags (preprocess keeps Megatron's own kebab-case
spellings), and a config given as `--config FILE[:ARG]` with any key overridden as
`--config.SECTION.KEY=VALUE` (the spelling of ml_collections' config_flags).

This module imports neither JAX nor the model: a tool parses and checks its command line,
then sets the CPU device count it needs (`cpu_devices`), and only then imports JAX.
"""

import argparse
import ast
import difflib
import json
import os
import sys
import tempfile

from mtnlg_jax.run import storage

CONFIG_PREFIX = '--config.'
DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def fail(message):
    """Print `error: message` to stderr and exit with status 2."""
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


def nothing_to_do(message):
    """Print `message` and exit with status 0: the command has no work left."""
    print(message)
    sys.exit(0)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (not usage text) and exit 2; no
    abbreviated flags (a prefix that works today would break when a flag is added).

    `add_config()` adds `--config FILE[:ARG]` and `--config.KEY=VALUE` overrides: parse_args
    then returns the loaded, overridden (not yet resolved) ConfigDict as `args.config`, and
    the overrides as given as `args.config_overrides` ({dotted key: text})."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault('allow_abbrev', False)
        kwargs.setdefault('formatter_class', argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self._config_flag = None

    def error(self, message):
        fail(self._typo(message) or message)

    def _typo(self, message):
        """For a missing or unrecognized flag: the flag given that looks like a typo of a known
        one ('unrecognized argument --workdri; did you mean --workdir?'), else None."""
        if 'required' not in message and 'unrecognized' not in message:
            return None
        known = [flag for flag in self._option_string_actions if flag.startswith('--')]
        for arg in getattr(self, '_argv', []):
            flag = arg.split('=', 1)[0]
            if flag == '--':
                break
            if flag.startswith('--') and flag not in known:
                close = difflib.get_close_matches(flag, known, n=1)
                if close:
                    return f'unrecognized argument {flag}; did you mean {close[0]}?'
        return None

    def add_config(self, default=None, help='an ml_collections file with get_config()'):
        self._config_flag = dict(default=default)
        self.add_argument(
            '--config',
            default=default,
            required=default is None,
            metavar='FILE[:ARG]',
            help=f'{help}; then --config.SECTION.KEY=VALUE overrides any key (see below)',
        )
        self.epilog = (self.epilog or '') + config_keys_help()

    def parse_args(self, argv=None):
        argv = list(sys.argv[1:] if argv is None else argv)
        overrides, rest = [], []
        if self._config_flag is not None:
            overrides, rest = split_overrides(argv)
        else:
            rest = argv
        self._argv = rest
        args = super().parse_args(rest)
        if self._config_flag is not None:
            args.config_path = args.config
            args.config = apply_overrides(load_config(args.config), overrides)
            args.config_overrides = dict(overrides)  # what the user set: {dotted key: text}
        return args


def config_keys_help():
    """The --help text listing every config key with its default and meaning (the key table)."""
    from mtnlg_jax.config import keys

    lines = ['\nconfig keys (--config.SECTION.KEY=VALUE; docs/cli.md has the table):']
    for key in keys.KEYS:
        lines.append(f'  {key.name}={key.default!r}: {key.doc}')
    return '\n'.join(lines)


def split_overrides(argv):
    """([(key, value text), ...], the other arguments) of a command line: `--config.K=V` and
    `--config.K V` are overrides."""
    overrides, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(CONFIG_PREFIX):
            key, equals, value = arg[len(CONFIG_PREFIX) :].partition('=')
            if not equals:
                if i + 1 >= len(argv) or argv[i + 1].startswith('--'):
                    fail(f'{arg}: give a value, as {arg}=VALUE')
                value, i = argv[i + 1], i + 1
            overrides.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def load_config(spec):
    """The ConfigDict of `FILE` or `FILE:ARG` (ARG passed to get_config); an error line names
    the file and what went wrong in it."""
    from mtnlg_jax import config as config_lib

    path, _, arg = spec.partition(':') if not os.path.isfile(spec) else (spec, '', '')
    if not os.path.isfile(path):
        fail(f'--config {path}: no such file')
    try:
        return config_lib.load(path, arg or None)
    except Exception as e:  # the config file is the user's code: any error is theirs
        fail(f'--config {spec}: {type(e).__name__}: {_one_line(e)}')


def apply_overrides(config, overrides):
    """`config` with each (dotted key, value text) set, typed as the key's current value."""
    for key, text in overrides:
        parent, name = _parent_of(config, key)
        current = parent[name]
        if hasattr(current, 'items'):
            fail(
                f'--config.{key}: is a section; set one of its keys, e.g. --config.{key}.'
                f'{next(iter(current.keys()))}=...'
            )
        value = parse_value(key, text, current)
        try:
            parent[name] = value
        except (TypeError, ValueError) as e:
            fail(f'--config.{key}={text}: {_one_line(e)}')
    return config


def _parent_of(config, key):
    """(the ConfigDict holding the last part of `key`, that part); error if a part is unknown,
    with the nearest known key suggested."""
    parts = key.split('.')
    node = config
    for depth, part in enumerate(parts):
        if not hasattr(node, 'keys') or part not in node.keys():
            known = list(node.keys()) if hasattr(node, 'keys') else []
            where = '.'.join(parts[:depth])
            close = difflib.get_close_matches(part, known, n=1)
            hint = f'; did you mean --config.{".".join(parts[:depth] + close)}?' if close else ''
            section = f'section {where}' if where else 'the config'
            fail(f'--config.{key}: {section} has no key {part!r}{hint}')
        if depth < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


TRUE, FALSE = ('true', '1', 'yes'), ('false', '0', 'no')


def parse_value(key, text, current):
    """The value of `text` for a key whose value is now `current` (its type decides)."""

    def bad(kind):
        fail(f'--config.{key}={text}: not {kind}')

    if isinstance(current, bool):
        if text.lower() not in TRUE + FALSE:
            bad('true or false')
        return text.lower() in TRUE
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)  # 1e9 and 12e9 are integers too
            except ValueError:
                bad('an integer')
            if not number.is_integer():
                bad('an integer')
            return int(number)
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            bad('a number')
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        if isinstance(current, (tuple, list)):
            bad('a Python tuple literal, e.g. "((1.0, \'data/corpus\'),)"')
        return text
    if isinstance(current, (tuple, list)) and not isinstance(value, (tuple, list)):
        bad('a tuple')
    return tuple(value) if isinstance(current, tuple) else value


def _one_line(error):
    text = str(error).strip().splitlines()
    return ' '.join(line.strip() for line in text) if text else type(error).__name__


def cpu_devices(count):
    """Make JAX's CPU platform offer `count` devices, as the tool's mesh needs; call before
    JAX is imported. Harmless on an accelerator machine (the flag shapes only the host
    platform); a count the user set in XLA_FLAGS is kept. Returns the count in force, or None
    if JAX was already imported (by a config file, say): then the config's mesh check says
    what to set."""
    if 'jax' in sys.modules:
        return None
    flags = os.environ.get('XLA_FLAGS', '')
    for flag in flags.split():
        if flag.startswith(DEVICE_COUNT_FLAG + '='):
            return int(flag.partition('=')[2])
    os.environ['XLA_FLAGS'] = f'{flags} {DEVICE_COUNT_FLAG}={count}'.strip()
    return count


def mesh_device_count(mesh, fill=8):
    """Devices a config's mesh section asks for; an axis of -1 fills `fill` devices (rounded up
    to a multiple of the other axes)."""
    from mtnlg_jax.config import keys

    known = keys.mesh_devices(mesh)
    if any(mesh[axis] == -1 for axis in keys.MESH_AXES):
        return max(known, -(-fill // known) * known)
    return known


def workdir_config(workdir):
    """A workdir's config.json (a dict), read without JAX; the error line names the file."""
    from mtnlg_jax.run.rundir import RunDir, RunDirError

    try:
        return RunDir(workdir).read_config()
    except RunDirError as e:
        fail(str(e))


def output_problem(path, directory=False):
    """Why `path` cannot be written (as a file; directory=True: as a folder to write into), or
    None: a file that is a folder (or the reverse), a folder that cannot be made, or one
    (or a file) this process may not write. Probes by creating a nameless file, so it holds
    for root without CAP_DAC_OVERRIDE and on read-only mounts alike."""
    path = os.path.abspath(path)
    if directory and os.path.exists(path) and not os.path.isdir(path):
        return 'exists and is not a folder'
    if not directory and os.path.isdir(path):
        return 'is a folder; give a file name'
    existing = path if directory else os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f'{existing} is not a folder'
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f'cannot be written under {existing} ({e.strerror})'
    if not directory and os.path.exists(path) and not os.access(path, os.W_OK):
        return 'is not writable'
    return None


def check_output(path, flag='--output', directory=False, make=False):
    """Error line naming `flag` unless `path` can be written (output_problem); make: create
    its folder (the folder itself with directory=True) now, before the work."""
    problem = output_problem(path, directory)
    if problem:
        fail(f'{flag} {path}: {problem}')
    if make:
        folder = path if directory else os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            fail(f'{flag} {path}: cannot make {folder} ({e.strerror})')


def write_json(path, value, flag='--output'):
    """`value` as JSON at `path`, atomically: a failure at the end (a full disk, a folder made
    read-only meanwhile) is one error line naming `flag`, and leaves the old file, or none,
    never a half-written one. Status 1 when the storage refused it (ENOSPC, EDQUOT, EROFS),
    else 2."""
    tmp = f'{path}.tmp{os.getpid()}'
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, 'w') as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if e.errno in storage.FULL:  # a run gone wrong at its end, not bad input: status 1
            print(f'error: {flag} {path}: not written ({e.strerror or e})', file=sys.stderr)
            sys.exit(1)
        fail(f'{flag} {path}: not written ({e.strerror or e})')


def check_output_file(path, flag='--output'):
    """Error unless `path` can be written as a file (not a folder, its folder creatable)."""
    check_output(path, flag)
