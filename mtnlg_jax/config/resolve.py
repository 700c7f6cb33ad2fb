"""The config: every input key with its default, what is derived, and resolve() that runs
the check of each section (checks.py).

Experiment files (configs/*.py) start from `defaults()` and change a few keys; every tool that
takes a config accepts any key on the command line as `--config.KEY=VALUE` (mtnlg_jax/run/cli.py).
`resolve()` checks each section against the device count before anything is built and derives
what follows from the inputs:

  mesh.*                    -1 filled with the devices the other axes leave
  model.ffn_hidden          0 -> 4 x hidden (GeLU), 8/3 x hidden up to model.ffn_multiple
                            (SwiGLU, Llama's rule)
  model.padded_vocab        vocab_size rounded up to a multiple of 128 x tensor (Megatron's rule)
  model.loss_chunks         0 -> the largest of 4, 3, 2, 1 that divides seq_len
  train.micro_steps         global_batch / (micro_batch x data), accumulated inside one step
                            (during a ramp-up, train.rampup, each smaller batch has fewer)
  optimizer.decay_tokens    0 -> all the tokens of the run, ramp-up included
  data / checkpoint paths   made absolute, so a workdir works from any directory

The resolved config carries the effective values where their readers look (the model reads
config.model), `derived` with every derived value, and `inputs`: the config as given (paths
absolute). A workdir's config.json stores all three; a run continued from it starts again
from `inputs`, so nothing derived (e.g. decay_tokens of an earlier train.steps) is ever read
back as an input. padded_vocab and micro_steps are not inputs at all.
"""

import math
import os

import ml_collections

from mtnlg_jax.config import keys
from mtnlg_jax.config.checks import (
    _require,
    check_data,
    check_packing,
    check_model,
    check_optimizer,
    check_train,
)


def defaults():
    """Every key a config may set, with the defaults of a GPT-2 small run (keys.py's table)."""
    return ml_collections.ConfigDict(keys.nested_defaults())


def resolve_mesh(mesh, num_devices):
    """{axis: size} of every mesh axis (keys.MESH_AXES, outermost first) with a -1 filled;
    ConfigError naming the key if a size is bad or they do not cover num_devices."""
    sizes = {axis: mesh[axis] for axis in keys.MESH_AXES}
    for axis, size in sizes.items():
        _require(
            isinstance(size, int) and (size > 0 or size == -1),
            f'mesh.{axis}',
            f'must be a positive integer or -1, got {size!r}',
        )
    fill = [axis for axis, size in sizes.items() if size == -1]
    _require(
        len(fill) <= 1,
        f'mesh.{fill[-1]}' if fill else 'mesh',
        f'only one mesh axis may be -1, got {", ".join("mesh." + a for a in fill)}',
    )
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        _require(
            num_devices % known == 0,
            f'mesh.{fill[0]}',
            f'-1 cannot fill {num_devices} devices: the other axes multiply to {known}',
        )
        sizes[fill[0]] = num_devices // known
    product = math.prod(sizes.values())
    shown = [axis for axis, size in sizes.items() if size != 1] or list(sizes)
    _require(
        product == num_devices,
        'mesh',
        f'{" x ".join(shown)} = {" x ".join(str(sizes[a]) for a in shown)} = {product}, but '
        f'there are {num_devices} devices',
    )
    return sizes


UNUSED_MESH_AXES = ()  # axes no rule of parallel/rules.py splits over yet (none today)


def check_mesh_in_use(mesh):
    """ConfigError on a mesh axis that no layer splits over yet (UNUSED_MESH_AXES)
    if it is above 1: its devices would repeat each other's work."""
    for axis in UNUSED_MESH_AXES:
        _require(
            mesh[axis] == 1,
            f'mesh.{axis}',
            f'must be 1 (got {mesh[axis]}): no layer splits over the {axis} axis yet',
        )


DERIVED_KEYS = (
    *(f'mesh.{axis}' for axis in keys.MESH_AXES),
    'model.ffn_hidden',
    'model.padded_vocab',
    'model.loss_chunks',
    'train.micro_steps',
    'optimizer.decay_tokens',
)


def _fill_missing(config, reference):
    """Keys of `reference` that `config` lacks, added with their values (recursively)."""
    for key, value in reference.items():
        if key not in config:
            config[key] = value
        elif isinstance(value, ml_collections.ConfigDict):
            if isinstance(config[key], ml_collections.ConfigDict):
                _fill_missing(config[key], value)


def inputs_of(config):
    """A copy of `config` without what resolve() adds (`derived`, `inputs`, and the keys that
    are never inputs). Re-resolving a resolved config keeps its filled values; a run continued
    from a workdir starts from the stored `inputs` instead (configs/workdir.py)."""
    config = ml_collections.ConfigDict(config.to_dict() if hasattr(config, 'to_dict') else config)
    for key in ('derived', 'inputs'):
        if key in config:
            del config[key]
    for section, name in (('model', 'padded_vocab'), ('train', 'micro_steps')):
        if section in config and name in config[section]:
            del config[section][name]
    return config


def resolve(config, num_devices):
    """A validated copy of `config` with the derived values (see the module docstring);
    ConfigError naming the key of the first fault. Each section has its own check. Keys added
    since `config` was saved (an older workdir's config.json) take their defaults."""
    inputs = absolute_paths(_with_defaults(inputs_of(config)))
    config = ml_collections.ConfigDict(inputs.to_dict())
    config.mesh.update(resolve_mesh(config.mesh, num_devices))
    check_model(config)  # before the unused axes: a dense model's mesh.expert has its own line
    check_mesh_in_use(config.mesh)
    check_train(config)
    check_data(config.data)
    check_packing(config)
    keys.check_values(config, ('checkpoint', 'distributed'))
    check_optimizer(config)
    derived = {}
    for key in DERIVED_KEYS:
        section, name = key.split('.')
        derived.setdefault(section, {})[name] = config[section][name]
    config.derived = derived
    config.inputs = inputs
    return config


def resolve_model(config, num_devices):
    """The mesh and model sections alone, resolved: what inference needs (no batch, schedule
    or data keys are checked, so a run's training settings never stop its evaluation)."""
    inputs = absolute_paths(_with_defaults(inputs_of(config)))
    config = ml_collections.ConfigDict(inputs.to_dict())
    config.mesh.update(resolve_mesh(config.mesh, num_devices))
    check_model(config)  # before the unused axes: a dense model's mesh.expert has its own line
    check_mesh_in_use(config.mesh)
    config.inputs = inputs
    return config


def _with_defaults(config):
    """Keys a config lacks take their defaults, but for pipeline.schedule: a run saved
    before the key existed ran (and continues in) the GPipe order."""
    if 'pipeline' in config and 'schedule' not in config.pipeline:
        config.pipeline.schedule = 'gpipe'
    _fill_missing(config, defaults())
    return config


def absolute_paths(config):
    """`config` with its file paths absolute (relative ones taken from the working directory),
    so a workdir's config.json means the same files wherever it is read."""
    data = config.data
    if isinstance(data.sources, (tuple, list)):
        data.sources = tuple(
            (s[0], os.path.abspath(s[1]))
            if isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[1], str) and s[1]
            else s
            for s in data.sources
        )
    if isinstance(data.tokenizer, str) and data.tokenizer:
        data.tokenizer = os.path.abspath(data.tokenizer)
    init_from = config.checkpoint.init_from
    if isinstance(init_from, str) and init_from:
        config.checkpoint.init_from = os.path.abspath(init_from)
    return config


def load(path, arg=None):
    """The `get_config()` (or `get_config(arg)`) of a config file, as --config FILE[:ARG]."""
    import importlib.util

    spec = importlib.util.spec_from_file_location('experiment_config', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)
