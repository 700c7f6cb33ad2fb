"""The run directory (a workdir): what a run keeps, where, written and read only here.

    WORKDIR/config.json              the run's config: "inputs" (as given, paths absolute),
                                     "derived" (what resolve() computed from them) and the
                                     resolved sections, which evaluation reads
    WORKDIR/checkpoints/<step>/      orbax checkpoints (mtnlg_jax/checkpoint/store.py writes them)
    WORKDIR/identity.json            what the run reads: its tokenizer's identity and vocabulary,
                                     and its data stream's fingerprint (data/identity.py);
                                     checked on every resume and every read of the run
    WORKDIR/metrics.jsonl            one record per logged step (train/metrics.py)
    WORKDIR/tensorboard/, loss.png   the same numbers for people
    WORKDIR/eval/<name>.json         evaluation results (launch/evaluate.py), one per task,
                                     data, shots and step
    WORKDIR/logs/                    per-process logs of multi-process runs

This module imports neither JAX nor orbax, so a launch script checks a workdir before anything
is compiled. Every path in config.json is absolute: a workdir is evaluated or continued from
any directory.
"""

import json
import os

CONFIG = 'config.json'
IDENTITY = 'identity.json'
CHECKPOINTS = 'checkpoints'
METRICS = 'metrics.jsonl'
TENSORBOARD = 'tensorboard'
LOSS_PNG = 'loss.png'
EVAL = 'eval'
LOGS = 'logs'


def changed_inputs(before, after, prefix=''):
    """[(dotted key, old, new), ...] between two input dicts (lists and tuples alike)."""
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += changed_inputs(old, new, f'{prefix}{key}.')
        elif _tuple(old) != _tuple(new):
            changes.append((f'{prefix}{key}', _tuple(old), _tuple(new)))
    return changes


def _tuple(value):
    return tuple(map(_tuple, value)) if isinstance(value, (list, tuple)) else value


class RunDirError(ValueError):
    """A workdir that cannot be used; the one-line message names it and why."""


class RunDir:
    """Paths of one workdir, and its config.json."""

    def __init__(self, path):
        self.path = str(path)
        self.config_path = self.join(CONFIG)
        self.identity_path = self.join(IDENTITY)
        self.checkpoints = self.join(CHECKPOINTS)
        self.metrics = self.join(METRICS)
        self.tensorboard = self.join(TENSORBOARD)
        self.loss_png = self.join(LOSS_PNG)

    def join(self, *names):
        return os.path.join(self.path, *names)

    def eval_output(self, name):
        return self.join(EVAL, f'{name}.json')

    def log(self, process_index):
        return self.join(LOGS, f'process_{process_index}.log')

    def check_writable(self, flag='--workdir'):
        """RunDirError unless the workdir is (or can become) a directory."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise RunDirError(f'{flag} {self.path}: exists and is not a directory')
        parent = os.path.dirname(os.path.abspath(self.path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise RunDirError(f'{flag} {self.path}: cannot be created under {parent}')
        for name in (CONFIG, IDENTITY, METRICS, CHECKPOINTS):
            path = self.join(name)
            if os.path.exists(path) and not os.access(path, os.W_OK):
                raise RunDirError(f'{flag} {self.path}: {path} is not writable')

    def saved_steps(self):
        """Steps of the complete checkpoints (orbax names each `<step>`; saves in flight or set
        aside carry a suffix)."""
        if not os.path.isdir(self.checkpoints):
            return []
        return sorted(int(name) for name in os.listdir(self.checkpoints) if name.isdigit())

    def has_config(self):
        return os.path.isfile(self.config_path)

    def read_config(self):
        """config.json as a dict; RunDirError if missing or not JSON."""
        if not self.has_config():
            raise RunDirError(
                f'{self.config_path} not found: --workdir must be a run of launch/train.py '
                f'(or an import of launch/convert.py)'
            )
        try:
            with open(self.config_path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise RunDirError(f'{self.config_path}: not readable JSON ({e})') from None
        if not isinstance(saved, dict) or 'model' not in saved:
            raise RunDirError(f'{self.config_path}: not the config of a run')
        return saved

    def read_inputs(self):
        """The config as its run was given it (derived values left to be recomputed), its
        sequences as tuples, as a config holds them (JSON has only lists)."""
        saved = self.read_config()
        inputs = saved.get('inputs')
        if inputs is None:  # written before inputs were kept apart: drop what is derived
            inputs = {k: v for k, v in saved.items() if k != 'derived'}
        return _tuples(inputs)

    def write_config(self, config_dict):
        """config.json (atomically: a killed write leaves the old one)."""
        _write_json(self.config_path, config_dict)

    def read_identity(self):
        """identity.json as a dict ({} for a run from before it was kept, or an import);
        RunDirError if it is not JSON."""
        if not os.path.isfile(self.identity_path):
            return {}
        try:
            with open(self.identity_path) as f:
                found = json.load(f)
        except (OSError, ValueError) as e:
            raise RunDirError(f'{self.identity_path}: not readable JSON ({e})') from None
        if not isinstance(found, dict):
            raise RunDirError(f'{self.identity_path}: not the identity of a run')
        return found

    def write_identity(self, identity):
        """identity.json (atomically)."""
        _write_json(self.identity_path, identity)


def _write_json(path, value):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + '.tmp'
    try:
        with open(tmp, 'w') as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, path)
    except BaseException:  # a full disk: the old file stays, no half-written one beside it
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _tuples(value):
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value
