"""The config: every input key with its default, a check per section, and what is derived.

Experiment files (configs/*.py) start from `defaults()` and change a few keys; every tool that
takes a config accepts any key on the command line as `--config.KEY=VALUE` (mtnlg_jax/cli.py).
`resolve()` checks each section against the device count before anything is built and derives
what follows from the inputs:

  mesh.{data,stage,tensor}  -1 filled with the devices the other axes leave
  model.ffn_hidden          0 -> 4 x hidden
  model.padded_vocab        vocab_size rounded up to a multiple of 128 x tensor (Megatron's rule)
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

from mtnlg_jax.data.gpt_dataset import parse_split
from mtnlg_jax.data import rampup

REMAT_POLICIES = ('none', 'full', 'selective')
PIPELINE_SCHEDULES = ('1f1b', 'interleaved', 'gpipe')
COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16')
VOCAB_PAD_MULTIPLE = 128
DATA_ORDERS = ('layout_independent', 'megatron')


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""

    def __init__(self, key, message):
        super().__init__(f'config key {key}: {message}')
        self.key = key


def defaults():
    """Every key a config may set, with the defaults of a GPT-2 small run."""
    config = ml_collections.ConfigDict()
    config.mesh = ml_collections.ConfigDict(dict(data=-1, stage=1, tensor=1))
    # schedule: 1f1b (memory flat in the micro-batch count; with repeats > 1 Megatron's
    # interleaved 1F1B), interleaved (the same, asking for repeats > 1), gpipe (for comparison).
    # max_in_flight: 1f1b only, at most this many stage inputs held per stage (0: as many as
    # lockstep ticks need, 2 (p - s) - 1 on stage s; p is Megatron's bound, at the cost of
    # idle ticks: parallel/schedule.py).
    config.pipeline = ml_collections.ConfigDict(dict(repeats=1, schedule='1f1b', max_in_flight=0))
    config.model = ml_collections.ConfigDict(
        dict(
            num_layers=12,
            hidden=768,
            heads=12,
            ffn_hidden=0,  # 0: 4 x hidden
            seq_len=1024,
            vocab_size=50257,
            init_std=0.02,
            layer_norm_epsilon=1e-5,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            compute_dtype='bfloat16',  # parameters and optimizer state are always fp32
            remat='none',  # none | full | selective
            # Megatron's sequence parallelism: layer norms, dropout and residual adds on
            # sequence shards split over mesh.tensor (parallel/rules.py).
            sequence_parallel=False,
        )
    )
    config.train = ml_collections.ConfigDict(
        dict(
            global_batch=512,
            micro_batch=1,  # sequences per data-parallel replica per accumulated micro-step
            steps=1000,
            seed=0,
            log_every=10,
            eval_every=500,  # 0: never
            eval_batches=8,
            # Batch-size ramp-up (start 0: none): from `start` sequences, `increment` at a time,
            # to global_batch over the first `tokens` tokens (MT-NLG: 32, 32, 12 B).
            rampup=ml_collections.ConfigDict(dict(start=0, increment=0, tokens=0)),
            # A step with a NaN or Inf loss or gradient norm is skipped (state unchanged);
            # this many in a row stop the run.
            max_consecutive_skips=10,
            # Loss-spike rollback, as PaLM did (spike_factor 0: off): a loss above
            # spike_factor x the mean of the last spike_window losses goes back to the newest
            # checkpoint and skips the batches up to the spike and spike_skip_batches more.
            spike_factor=0.0,
            spike_window=20,
            spike_skip_batches=0,
            # Fault drills, to check on a real cluster what a bad step does (0: never): steps
            # inject_nan_at_step .. + inject_nan_steps - 1 get a NaN loss and gradients;
            # step inject_spike_at_step reports 10 x its loss; at step inject_kill_at_step of
            # a run started from scratch (not resumed), process inject_kill_process kills
            # itself (SIGKILL, a lost node): the others must end within
            # distributed.heartbeat_timeout_s, and the same command resumes.
            inject_nan_at_step=0,
            inject_nan_steps=1,
            inject_spike_at_step=0,
            inject_kill_at_step=0,
            inject_kill_process=0,
        )
    )
    # Adam as in the MT-NLG paper; the learning rate is a function of tokens seen, as there:
    # linear warmup over warmup_tokens, then cosine decay to min_lr at decay_tokens (counted
    # from the start, warmup included).
    config.optimizer = ml_collections.ConfigDict(
        dict(
            lr=6e-4,
            min_lr=6e-5,
            warmup_tokens=0,
            decay_tokens=0,  # 0: the run's total
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            clip_norm=1.0,
        )
    )
    # init_from: a workdir (or checkpoint directory) of another run whose newest checkpoint
    # gives this run's initial parameters (with init_full_state: its whole state and data
    # position), under any layout. Used only while this workdir has no checkpoint of its own.
    config.checkpoint = ml_collections.ConfigDict(
        dict(every=0, keep=3, init_from='', init_full_state=False)
    )
    # sources: (weight, path prefix of a .bin/.idx pair) ..., blended by weight; split: the
    # train, valid and test shares of each source's documents, as Megatron's --split.
    # order: layout_independent (sample i depends on i alone, not on the run's length) or
    # megatron (Megatron-LM's GPTDataset and BlendedDataset order exactly, sized by the run's
    # samples as its --train-samples; to continue or compare a Megatron-LM run).
    config.data = ml_collections.ConfigDict(
        dict(
            sources=((0.5, 'data/default/kjv'), (0.5, 'data/default/python_stdlib')),
            split='969,30,1',
            tokenizer='data/default/tokenizer.model',
            order='layout_independent',
        )
    )
    # Several processes (mtnlg_jax/distributed.py): one that sends no heartbeat for
    # heartbeat_timeout_s ends them all (JAX's default of 100 s leaves survivors hanging);
    # the others wait up to initialization_timeout_s for process 0 to start.
    config.distributed = ml_collections.ConfigDict(
        dict(heartbeat_timeout_s=30, initialization_timeout_s=300)
    )
    return config


def _require(condition, key, message):
    if not condition:
        raise ConfigError(key, message)


def _positive(config, *keys):
    for key in keys:
        section, name = key.split('.')
        value = config[section][name]
        _require(
            isinstance(value, int) and value > 0, key, f'must be a positive integer, got {value!r}'
        )


def resolve_mesh(mesh, num_devices):
    """(data, stage, tensor) with a -1 filled; ConfigError if they do not cover num_devices."""
    sizes = {axis: mesh[axis] for axis in ('data', 'stage', 'tensor')}
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
    _require(
        product == num_devices,
        'mesh',
        f'data x stage x tensor = {sizes["data"]} x {sizes["stage"]} x {sizes["tensor"]} = '
        f'{product}, but there are {num_devices} devices',
    )
    return sizes


def padded_vocab_size(vocab_size, tensor):
    multiple = VOCAB_PAD_MULTIPLE * tensor
    return -(-vocab_size // multiple) * multiple


DERIVED_KEYS = (
    'mesh.data',
    'mesh.stage',
    'mesh.tensor',
    'model.ffn_hidden',
    'model.padded_vocab',
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
    check_model(config)
    check_train(config)
    check_data(config.data)
    check_checkpoint(config.checkpoint)
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
    check_model(config)
    config.inputs = inputs
    return config


def _with_defaults(config):
    """Keys a config lacks take their defaults, but for pipeline.schedule: a run saved
    before the key existed ran (and continues in) the GPipe order."""
    if 'pipeline' in config and 'schedule' not in config.pipeline:
        config.pipeline.schedule = 'gpipe'
    _fill_missing(config, defaults())
    return config


def _get(config, key):
    section, name = key.split('.')
    return config[section][name]


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


def check_model(config):
    """model.*, against the (filled) mesh; fills ffn_hidden and padded_vocab."""
    model, mesh = config.model, config.mesh
    _positive(
        config,
        'model.num_layers',
        'model.hidden',
        'model.heads',
        'model.seq_len',
        'model.vocab_size',
        'pipeline.repeats',
    )
    _require(
        isinstance(model.ffn_hidden, int) and model.ffn_hidden >= 0,
        'model.ffn_hidden',
        f'must be 0 (4 x hidden) or a positive integer, got {model.ffn_hidden!r}',
    )
    if model.ffn_hidden == 0:
        model.ffn_hidden = 4 * model.hidden
    tensor = mesh.tensor
    _require(
        model.hidden % model.heads == 0,
        'model.hidden',
        f'{model.hidden} is not divisible by model.heads={model.heads}',
    )
    _require(
        model.heads % tensor == 0,
        'model.heads',
        f'{model.heads} heads are not divisible by mesh.tensor={tensor}',
    )
    _require(
        model.ffn_hidden % tensor == 0,
        'model.ffn_hidden',
        f'{model.ffn_hidden} is not divisible by mesh.tensor={tensor}',
    )
    _divisible(
        'model.num_layers',
        f'{model.num_layers} layers',
        model.num_layers,
        ('mesh.stage', mesh.stage),
        ('pipeline.repeats', config.pipeline.repeats),
    )
    _require(
        model.remat in REMAT_POLICIES,
        'model.remat',
        f'{model.remat!r} is not one of {", ".join(REMAT_POLICIES)}',
    )
    _require(
        model.compute_dtype in COMPUTE_DTYPES,
        'model.compute_dtype',
        f'{model.compute_dtype!r} is not one of {", ".join(COMPUTE_DTYPES)}',
    )
    if 'sequence_parallel' not in model:  # a run saved before the key existed
        model.sequence_parallel = False
    _require(
        isinstance(model.sequence_parallel, bool),
        'model.sequence_parallel',
        f'must be True or False, got {model.sequence_parallel!r}',
    )
    _require(
        not model.sequence_parallel or model.seq_len % tensor == 0,
        'model.sequence_parallel',
        f'needs model.seq_len={model.seq_len} divisible by mesh.tensor={tensor}',
    )
    for key in ('attention_dropout', 'hidden_dropout'):
        _require(0.0 <= model[key] < 1.0, f'model.{key}', f'must be in [0, 1), got {model[key]}')
    _require(model.init_std > 0, 'model.init_std', f'must be positive, got {model.init_std}')
    model.padded_vocab = padded_vocab_size(model.vocab_size, tensor)


def check_train(config):
    """train.*: batch against the mesh, ramp-up, pipeline fill, cadences, fault drills; fills
    micro_steps."""
    train = config.train
    _positive(
        config,
        'train.global_batch',
        'train.micro_batch',
        'train.steps',
        'train.log_every',
        'train.eval_batches',
        'train.max_consecutive_skips',
        'train.inject_nan_steps',
        'train.spike_window',
    )
    _non_negative(
        config,
        'train.eval_every',
        'train.inject_nan_at_step',
        'train.inject_spike_at_step',
        'train.inject_kill_at_step',
        'train.inject_kill_process',
        'train.spike_skip_batches',
    )
    replica_batch = _divisible(
        'train.global_batch',
        str(train.global_batch),
        train.global_batch,
        ('train.micro_batch', train.micro_batch),
        ('mesh.data', config.mesh.data),
    )
    train.micro_steps = train.global_batch // replica_batch
    _check_rampup(train, replica_batch)
    _check_pipeline(config, replica_batch)
    _require(
        train.spike_factor == 0 or train.spike_factor > 1,
        'train.spike_factor',
        f'must be 0 (off) or above 1, got {train.spike_factor}',
    )


def check_checkpoint(checkpoint):
    _require(
        isinstance(checkpoint.keep, int) and checkpoint.keep > 0,
        'checkpoint.keep',
        f'must be a positive integer, got {checkpoint.keep!r}',
    )
    _require(
        isinstance(checkpoint.every, int) and checkpoint.every >= 0,
        'checkpoint.every',
        f'must be an integer >= 0, got {checkpoint.every!r}',
    )


def check_optimizer(config):
    """optimizer.*; fills decay_tokens (0: the run's tokens) from train.steps and the ramp."""
    opt, train, model = config.optimizer, config.train, config.model
    _require(opt.lr > 0, 'optimizer.lr', f'must be positive, got {opt.lr}')
    _require(
        0 <= opt.min_lr <= opt.lr,
        'optimizer.min_lr',
        f'must be in [0, optimizer.lr={opt.lr}], got {opt.min_lr}',
    )
    _require(
        opt.warmup_tokens >= 0, 'optimizer.warmup_tokens', f'must be >= 0, got {opt.warmup_tokens}'
    )
    _require(
        opt.decay_tokens >= 0,
        'optimizer.decay_tokens',
        f'must be 0 (the run\'s tokens) or positive, got {opt.decay_tokens}',
    )
    if opt.decay_tokens == 0:
        opt.decay_tokens = rampup.total_samples(train, model.seq_len) * model.seq_len
    _require(
        opt.decay_tokens > opt.warmup_tokens,
        'optimizer.decay_tokens',
        f'{opt.decay_tokens} must exceed optimizer.warmup_tokens={opt.warmup_tokens}',
    )
    _require(opt.clip_norm >= 0, 'optimizer.clip_norm', f'must be >= 0, got {opt.clip_norm}')


def _divisible(key, what, value, *factors):
    """The product of (name, size) factors; ConfigError on `key` unless it divides value."""
    product = math.prod(size for _, size in factors)
    _require(
        value % product == 0,
        key,
        f'{what} {"is" if what.isdigit() else "are"} not divisible by '
        f'{" x ".join(name for name, _ in factors)} = '
        f'{" x ".join(str(size) for _, size in factors)} = {product}',
    )
    return product


def _non_negative(config, *keys):
    for key in keys:
        value = _get(config, key)
        _require(
            isinstance(value, int) and value >= 0, key, f'must be an integer >= 0, got {value!r}'
        )


def _check_pipeline(config, replica_batch):
    """A known schedule; interleaving needs repeats > 1; GPipe's circular order (repeats > 1)
    needs at least `stage` micro-batches in every step, the smallest batch of a ramp-up
    included (1F1B-family schedules take any count)."""
    stage, repeats, train = config.mesh.stage, config.pipeline.repeats, config.train
    if 'schedule' not in config.pipeline:  # a run saved before the key existed: GPipe order
        config.pipeline.schedule = 'gpipe'
    schedule = config.pipeline.schedule
    _require(
        schedule in PIPELINE_SCHEDULES,
        'pipeline.schedule',
        f'{schedule!r} is not one of {", ".join(PIPELINE_SCHEDULES)}',
    )
    _require(
        schedule != 'interleaved' or repeats > 1,
        'pipeline.schedule',
        'interleaved needs pipeline.repeats > 1 (chunks per stage); with 1 use 1f1b',
    )
    in_flight = config.pipeline.max_in_flight
    _require(
        in_flight >= 0,
        'pipeline.max_in_flight',
        f'must be >= 0 (0: no bound), got {in_flight}',
    )
    _require(
        not in_flight or (schedule == '1f1b' and repeats == 1),
        'pipeline.max_in_flight',
        f'bounds the 1f1b table with pipeline.repeats 1 only (got schedule {schedule!r}, '
        f'repeats {repeats})',
    )
    if schedule != 'gpipe':
        return
    key, smallest = 'train.global_batch', train.global_batch
    if train.rampup.start:
        key, smallest = 'train.rampup.start', train.rampup.start
    _require(
        repeats == 1 or smallest // replica_batch >= stage,
        key,
        f'the circular pipeline (mesh.stage={stage}, pipeline.repeats={repeats}) needs at least '
        f'{stage} micro-batches per step, but {key} / (train.micro_batch x mesh.data) = '
        f'{smallest} / ({train.micro_batch} x {config.mesh.data}) = {smallest // replica_batch}',
    )


def _check_rampup(train, replica_batch):
    """Every batch of the ramp must split into whole micro-steps of micro_batch x data."""
    ramp = train.rampup
    if not ramp.start:
        return
    for name in ('start', 'increment', 'tokens'):
        value = ramp[name]
        _require(
            isinstance(value, int) and value > 0,
            f'train.rampup.{name}',
            f'must be a positive integer when train.rampup.start is set, got {value!r}',
        )
    _require(
        ramp.start < train.global_batch,
        'train.rampup.start',
        f'{ramp.start} must be below train.global_batch={train.global_batch}',
    )
    _require(
        (train.global_batch - ramp.start) % ramp.increment == 0,
        'train.rampup.increment',
        f'{ramp.increment} does not step from train.rampup.start={ramp.start} to '
        f'train.global_batch={train.global_batch}',
    )
    for name in ('start', 'increment'):
        _require(
            ramp[name] % replica_batch == 0,
            f'train.rampup.{name}',
            f'{ramp[name]} is not divisible by train.micro_batch x mesh.data = {replica_batch}, '
            f'so some batch of the ramp would not split into micro-steps',
        )


def check_data(data):
    sources = data.sources
    _require(
        isinstance(sources, (tuple, list))
        and len(sources) > 0
        and all(
            isinstance(s, (tuple, list))
            and len(s) == 2
            and isinstance(s[0], (int, float))
            and s[0] > 0
            and isinstance(s[1], str)
            and s[1]
            for s in sources
        ),
        'data.sources',
        f'must be ((weight > 0, path prefix), ...), got {sources!r}',
    )
    try:
        train, valid, _ = parse_split(data.split)
    except (ValueError, AttributeError) as e:
        raise ConfigError('data.split', str(e)) from None
    _require(
        train > 0 and valid > 0, 'data.split', f'{data.split!r} leaves no train or valid share'
    )
    _require(
        data.order in DATA_ORDERS,
        'data.order',
        f'must be one of {", ".join(DATA_ORDERS)}, got {data.order!r}',
    )


def load(path, arg=None):
    """The `get_config()` (or `get_config(arg)`) of a config file, as --config FILE[:ARG]."""
    import importlib.util

    spec = importlib.util.spec_from_file_location('experiment_config', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)
