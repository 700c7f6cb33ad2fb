"""The config's checks: one per section, each raising ConfigError naming the first bad key.

config.resolve() runs them, against the device count, before anything is built; they also
fill what a section derives from its own keys (model.padded_vocab, train.micro_steps,
optimizer.decay_tokens), which resolve() then records under `derived`.
"""

import math

from mtnlg_jax.config import rampup

REMAT_POLICIES = ('none', 'full', 'selective')
ATTENTION = ('auto', 'fused', 'flash', 'plain')
PIPELINE_SCHEDULES = ('1f1b', 'interleaved', 'gpipe')
COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16')
VOCAB_PAD_MULTIPLE = 128
DATA_ORDERS = ('layout_independent', 'megatron')
SAVE_ERROR_ACTIONS = ('stop', 'continue')


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""

    def __init__(self, key, message):
        super().__init__(f'config key {key}: {message}')
        self.key = key


def parse_split(split):
    """'969,30,1' (or '969/30/1', missing parts 0) -> three non-negative weights; ValueError.
    Megatron's --split: the data's document split (data/gpt_dataset.py) reads it from here."""
    try:
        weights = [float(part) for part in split.replace('/', ',').split(',')]
    except ValueError:
        weights = [-1.0]
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f'{split!r} is not up to three non-negative weights, e.g. "969,30,1"')
    return weights + [0.0] * (3 - len(weights))


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


def padded_vocab_size(vocab_size, tensor):
    multiple = VOCAB_PAD_MULTIPLE * tensor
    return -(-vocab_size // multiple) * multiple


def _get(config, key):
    section, name = key.split('.')
    return config[section][name]


def check_model(config):
    """model.*, against the (filled) mesh; fills ffn_hidden, padded_vocab and loss_chunks."""
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
    if 'attention' not in model:  # a run saved before the key existed
        model.attention = 'auto'
    _require(
        model.attention in ATTENTION,
        'model.attention',
        f'{model.attention!r} is not one of {", ".join(ATTENTION)}',
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
    if 'loss_chunks' not in model:  # a run saved before the key existed
        model.loss_chunks = 0
    _require(
        isinstance(model.loss_chunks, int)
        and model.loss_chunks >= 0
        and (model.loss_chunks == 0 or model.seq_len % model.loss_chunks == 0),
        'model.loss_chunks',
        f'must be 0 (up to 4 pieces) or divide model.seq_len={model.seq_len}, '
        f'got {model.loss_chunks!r}',
    )
    if model.loss_chunks == 0:
        model.loss_chunks = next(n for n in (4, 3, 2, 1) if model.seq_len % n == 0)
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
        'train.hang_floor_s',
    )
    _non_negative(
        config,
        'train.eval_every',
        'train.inject_nan_at_step',
        'train.inject_spike_at_step',
        'train.inject_kill_at_step',
        'train.inject_kill_process',
        'train.inject_hang_at_step',
        'train.inject_hang_process',
        'train.hang_timeout_s',
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
    _require(
        checkpoint.on_save_error in SAVE_ERROR_ACTIONS,
        'checkpoint.on_save_error',
        f'must be one of {", ".join(SAVE_ERROR_ACTIONS)}, got {checkpoint.on_save_error!r}',
    )
    _require(
        isinstance(checkpoint.inject_save_error_at_step, int)
        and checkpoint.inject_save_error_at_step >= 0,
        'checkpoint.inject_save_error_at_step',
        f'must be an integer >= 0, got {checkpoint.inject_save_error_at_step!r}',
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
