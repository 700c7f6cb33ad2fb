"""The config's checks across keys, one per section, each raising ConfigError naming the
first bad key; what a key checks of itself is its row of the key table (keys.py).

config.resolve() runs them, against the device count, before anything is built; they also
fill what a section derives from its own keys (model.padded_vocab, train.micro_steps,
optimizer.decay_tokens), which resolve() then records under `derived`.
"""

import math
import re

from mtnlg_jax.config import rampup, stage_layers
from mtnlg_jax.config.keys import BY_NAME, ConfigError, check_values

VOCAB_PAD_MULTIPLE = 128
FLASH_MIN_BLOCK = 16  # the Pallas flash kernel's smallest tile (model/flash_attention.py)


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


def padded_vocab_size(vocab_size, tensor):
    multiple = VOCAB_PAD_MULTIPLE * tensor
    return -(-vocab_size // multiple) * multiple


def check_model(config):
    """model.* against the (filled) mesh; fills ffn_hidden, padded_vocab and loss_chunks."""
    check_values(config, ('model', 'pipeline'))
    model, tensor = config.model, config.mesh.tensor
    check_block(model)
    if model.ffn_hidden == 0:
        model.ffn_hidden = default_ffn_hidden(model)
    _require(
        model.heads % tensor == 0,
        'model.heads',
        f'{model.heads} heads are not divisible by mesh.tensor={tensor}',
    )
    _require(
        model.kv_heads == 0 or model.kv_heads % tensor == 0,
        'model.kv_heads',
        f'{model.kv_heads} key/value heads are not divisible by mesh.tensor={tensor}: each '
        f'tensor rank holds whole key/value heads (replicating them, as MaxText does, is not '
        f'supported)',
    )
    _require(
        model.ffn_hidden % tensor == 0,
        'model.ffn_hidden',
        f'{model.ffn_hidden} is not divisible by mesh.tensor={tensor}',
    )
    check_moe(model, config.mesh)
    _check_fp8(model, tensor)
    _check_stage_layers(config)
    _require(
        not model.sequence_parallel or model.seq_len % tensor == 0,
        'model.sequence_parallel',
        f'needs model.seq_len={model.seq_len} divisible by mesh.tensor={tensor}',
    )
    _check_context(config)
    context = config.mesh.context
    shards = (tensor if model.sequence_parallel else 1) * context
    over = [f'mesh.{k}={v}' for k, v in (('context', context), ('tensor', shards // context))]
    _require(
        model.seq_len % (shards * model.sequence_pieces) == 0,
        'model.sequence_pieces',
        f'{model.sequence_pieces} pieces do not divide the {model.seq_len // shards} tokens of '
        f'a sequence shard (model.seq_len={model.seq_len}'
        + (f' over {" x ".join(o for o in over if not o.endswith("=1"))})' if shards > 1 else ')'),
    )
    shard = model.seq_len // context  # the loss cuts each context rank's shard in pieces
    _require(
        model.loss_chunks == 0 or shard % model.loss_chunks == 0,
        'model.loss_chunks',
        f'must be 0 (up to 4 pieces) or divide model.seq_len={model.seq_len}'
        + (f' / mesh.context={context}' if context > 1 else '')
        + f', got {model.loss_chunks!r}',
    )
    if model.loss_chunks == 0:
        model.loss_chunks = next(n for n in (4, 3, 2, 1) if shard % n == 0)
    model.padded_vocab = padded_vocab_size(model.vocab_size, tensor)


def _check_context(config):
    """mesh.context > 1: the sequence cuts into 2 x context chunks (each split over tensor
    under sequence parallelism); attention runs the Pallas flash kernel (a chunk a multiple
    of its smallest tile) or the plain path, not cuDNN's (no query offset)."""
    model, context = config.model, config.mesh.context
    if context == 1:
        return
    tensor = config.mesh.tensor if model.sequence_parallel else 1
    multiple = 2 * context * tensor
    _require(
        model.seq_len % multiple == 0,
        'mesh.context',
        f'model.seq_len={model.seq_len} does not cut into 2 x {context} chunks'
        + (f' split over mesh.tensor={tensor} (sequence parallel)' if tensor > 1 else '')
        + f': it must be a multiple of {multiple}',
    )
    _require(
        model.attention != 'fused',
        'model.attention',
        f"'fused' cannot run with mesh.context={context}: cuDNN's kernel does not take a query "
        f"chunk's offset (flash, auto or plain)",
    )
    chunk = model.seq_len // (2 * context)
    _require(
        model.attention != 'flash' or chunk % FLASH_MIN_BLOCK == 0,
        'mesh.context',
        f'the Pallas flash kernel needs each of the 2 x {context} chunks of model.seq_len='
        f'{model.seq_len} a multiple of {FLASH_MIN_BLOCK} tokens (got {chunk})',
    )


def _check_fp8(model, tensor):
    """model.fp8: half-precision compute; blockwise: every contracted and weight dimension
    (a tensor shard's) whole 128-wide blocks, or one block narrower than 128."""
    fp8 = model.get('fp8', 'none')
    _require(
        fp8 == 'none' or model.compute_dtype != 'float32',
        'model.fp8',
        f'{fp8} FP8 needs bfloat16 or float16 compute, not model.compute_dtype=float32',
    )
    if fp8 != 'blockwise':
        return
    heads, kv_heads = model.heads, model.kv_heads or model.heads
    head_dim = model.head_dim or model.hidden // model.heads
    widths = {
        'model.hidden': model.hidden,
        'model.ffn_hidden': model.ffn_hidden // tensor,
        'the query heads x head_dim': heads * head_dim // tensor,
        'the key/value heads x head_dim': kv_heads * head_dim // tensor,
    }
    if model.moe.experts:  # each expert whole on its rank when folded, else split by width
        split = 1 if model.moe.get('fold_tensor', False) else tensor
        widths['model.moe.ffn_hidden'] = moe_ffn_hidden(model) // split
        widths['the shared experts\' width'] = shared_ffn_hidden(model) // tensor
    for name, width in widths.items():
        _require(
            width <= 128 or width % 128 == 0,
            'model.fp8',
            f'blockwise FP8 takes blocks of 128: {name} ({width} a tensor rank) is neither a '
            f'multiple of 128 nor at most 128',
        )


def _check_fold(model, mesh):
    """model.moe.fold_tensor: the experts over expert x tensor, each tensor rank its 1/t of
    every sequence's rows (model/moe.py's folded exchange), whole sequences (no context)."""
    moe = model.moe
    if not moe.fold_tensor:
        return
    ranks = mesh.expert * mesh.tensor
    _require(
        moe.experts % ranks == 0,
        'model.moe.fold_tensor',
        f'{moe.experts} experts are not divisible by mesh.expert x mesh.tensor={ranks}',
    )
    _require(
        model.seq_len % mesh.tensor == 0,
        'model.moe.fold_tensor',
        f'model.seq_len={model.seq_len} is not divisible by mesh.tensor={mesh.tensor}',
    )
    _require(
        mesh.get('context', 1) == 1,
        'model.moe.fold_tensor',
        f'mesh.context={mesh.context}: capacity counts whole sequences, which context splits',
    )


def check_moe(model, mesh):
    """model.moe.* against the block and the mesh: top_k within the experts, the experts over
    mesh.expert, the experts' widths over mesh.tensor, dense_layers below num_layers; a dense
    model refuses mesh.expert > 1 and dense_layers > 0."""
    moe, tensor = model.moe, mesh.tensor
    if moe.experts == 0:
        dense = 'but the model is dense (model.moe.experts is 0)'
        _require(mesh.expert == 1, 'mesh.expert', f'{mesh.expert} expert ranks, {dense}')
        _require(
            moe.dense_layers == 0,
            'model.moe.dense_layers',
            f'{moe.dense_layers} dense layers ahead of the experts, {dense}',
        )
        return
    _require(
        moe.top_k <= moe.experts,
        'model.moe.top_k',
        f'{moe.top_k} is above model.moe.experts={moe.experts}',
    )
    _require(
        moe.experts % mesh.expert == 0,
        'model.moe.experts',
        f'{moe.experts} experts are not divisible by mesh.expert={mesh.expert}',
    )
    widths = (
        ('ffn_hidden', moe_ffn_hidden(model)),
        ('shared_ffn_hidden', shared_ffn_hidden(model)),
    )
    _check_fold(model, mesh)
    for name, width in widths:
        _require(
            width % (1 if name == 'ffn_hidden' and moe.fold_tensor else tensor) == 0,
            f'model.moe.{name}',
            f'{width} is not divisible by mesh.tensor={tensor}',
        )
    _require(
        moe.dense_layers < model.num_layers,
        'model.moe.dense_layers',
        f'{moe.dense_layers} dense layers leave no MoE layer of model.num_layers='
        f'{model.num_layers} (at most {model.num_layers - 1})',
    )
    _require(
        not moe.dense_layers or model.get('fp8', 'none') != 'delayed',
        'model.moe.dense_layers',
        f"{moe.dense_layers} dense layers under model.fp8 = 'delayed': the dense stack keeps no "
        f'FP8 amax history (tensorwise and blockwise run)',
    )


def replicas(mesh):
    """The batch's replicas: mesh.data x mesh.expert (expert ranks are data-parallel for every
    parameter but the experts)."""
    return mesh.data * mesh.expert


def block_stack_layers(model):
    """Layers in the scanned block stack `blocks`: model.num_layers less the dense layers
    ahead of a mixture of experts (model.moe.dense_layers), which a stack of their own holds."""
    return model.num_layers - (model.moe.dense_layers if 'moe' in model else 0)


def moe_ffn_hidden(model):
    """Each routed expert's MLP width: model.moe.ffn_hidden, 0 meaning model.ffn_hidden."""
    return model.moe.ffn_hidden or model.ffn_hidden


def shared_ffn_hidden(model):
    """The shared experts' width (one MLP for all of them): model.moe.shared_ffn_hidden, 0
    meaning shared_experts x the routed experts' width (0 when there are none)."""
    return model.moe.shared_ffn_hidden or model.moe.shared_experts * moe_ffn_hidden(model)


def default_ffn_hidden(model):
    """model.ffn_hidden 0: 4 x hidden for GeLU; for SwiGLU Llama's int(8 hidden / 3) rounded
    up to a multiple of model.ffn_multiple (same parameters as a 4 x hidden GeLU MLP)."""
    if model.get('mlp', 'gelu') == 'gelu':
        return 4 * model.hidden
    multiple = model.get('ffn_multiple', 256)
    return -(-int(8 * model.hidden / 3) // multiple) * multiple


def check_block(model):
    """The block options across keys (position, rope, GQA, head_dim): each a ConfigError
    naming the key, before anything is built; the keys' own values are the table's."""
    _require(
        model.head_dim > 0 or model.hidden % model.heads == 0,
        'model.hidden',
        f'{model.hidden} is not divisible by model.heads={model.heads} (or set model.head_dim)',
    )
    _require(
        model.kv_heads == 0 or model.heads % model.kv_heads == 0,
        'model.kv_heads',
        f'{model.kv_heads} key/value heads do not divide model.heads={model.heads}',
    )
    _check_rope(model)
    _check_recompute(model)


RECOMPUTABLE = ('qkv', 'context', 'attn_out', 'mlp_in', 'mlp_gate', 'mlp_up', 'mlp_out')
SWIGLU_INPUTS = ('mlp_gate', 'mlp_up')  # SwiGLU's input projections: 'mlp_in' names both


def _given(model, key):
    return tuple(n.strip() for n in model.get(key, '').split(',') if n.strip())


def mlp_inputs(model):
    """The model's names of its MLP's input projections: SwiGLU's gate and up, GeLU's one."""
    return SWIGLU_INPUTS if model.get('mlp', 'gelu') == 'swiglu' else ('mlp_in',)


def _names(model, key):
    """The model's names (model/block.py's SELECTIVE_SAVED) for those given: 'mlp_in' is
    every input projection of the MLP (mlp_inputs)."""
    parts = (mlp_inputs(model) if n == 'mlp_in' else (n,) for n in _given(model, key))
    return tuple(dict.fromkeys(n for names in parts for n in names))


def recomputed(model):
    """model.remat_recompute's names, in the order given ('mlp_in' read as the model's)."""
    return _names(model, 'remat_recompute')


def offloaded(model):
    """model.remat_offload's names, in the order given ('mlp_in' read as the model's)."""
    return _names(model, 'remat_offload')


def _check_recompute(model):
    for name in ('remat_recompute', 'remat_offload'):
        key, names = f'model.{name}', _given(model, name)
        unknown = [n for n in names if n not in RECOMPUTABLE]
        _require(not unknown, key, f'{", ".join(unknown)} is not one of {", ".join(RECOMPUTABLE)}')
        gelu = [n for n in names if n in SWIGLU_INPUTS and n not in mlp_inputs(model)]
        _require(
            not gelu,
            key,
            f'{", ".join(gelu)} names a SwiGLU projection, but model.mlp is gelu (its input '
            "projection is 'mlp_in')",
        )
        _require(
            not names or model.remat == 'selective',
            key,
            f'names what selective recompute keeps, but model.remat={model.remat}',
        )
    both = [n for n in offloaded(model) if n in recomputed(model)]
    _require(
        not both,
        'model.remat_offload',
        f'{", ".join(both)} is made again (model.remat_recompute): there is nothing to hold',
    )


def _check_rope(model):
    scaling = model.rope_scaling
    if model.position == 'learned':
        for key, value, default in (
            ('rope_theta', model.rope_theta, BY_NAME['model.rope_theta'].default),
            ('rope_scaling.type', scaling.type, 'none'),
        ):
            _require(
                value == default,
                f'model.{key}',
                f'{value!r} sets rotary positions, but model.position is learned (set '
                f"model.position='rope')",
            )
        return
    head_dim = model.head_dim or model.hidden // model.heads
    _require(
        head_dim % 2 == 0,
        'model.head_dim',
        f'rope rotates pairs of channels: head dim {head_dim} must be even',
    )
    if scaling.type == 'llama3':
        _require(
            scaling.factor >= 1, 'model.rope_scaling.factor', f'must be >= 1, got {scaling.factor}'
        )
        _require(
            scaling.low_freq_factor < scaling.high_freq_factor,
            'model.rope_scaling.low_freq_factor',
            f'must be below high_freq_factor={scaling.high_freq_factor}, got '
            f'{scaling.low_freq_factor}',
        )


def _check_stage_layers(config):
    """The block stack (model.num_layers less the dense layers ahead of the experts, which
    the first stage runs beside the embedding) over the stages: evenly, or with first / last
    stages of their own."""
    model, pipeline, stages = config.model, config.pipeline, config.mesh.stage
    first, last = pipeline.first_stage_layers, pipeline.last_stage_layers
    layers = block_stack_layers(model)
    dense = layers != model.num_layers
    what = f'{layers} MoE layers (model.num_layers less model.moe.dense_layers)' if dense else ''
    _require(
        not dense or stages == 1 or pipeline.schedule != 'gpipe',
        'model.moe.dense_layers',
        f'{model.num_layers - layers} dense layers run on the 1f1b, interleaved, zbh1 and zbv '
        f'schedules, not gpipe (its embedding runs on every micro-batch at once)',
    )
    if not (first or last) or stages == 1:
        _divisible(
            'model.num_layers',
            what or f'{layers} layers',
            layers,
            ('mesh.stage', stages),
            ('pipeline.repeats', pipeline.repeats),
        )
        return
    key = 'pipeline.first_stage_layers' if first else 'pipeline.last_stage_layers'
    try:
        stage_layers.per_stage(layers, stages, pipeline.repeats, first, last)
    except ValueError as e:
        raise ConfigError(
            key, f'{e} (model.num_layers={model.num_layers}{what and ": " + what})'
        ) from None
    _require(
        pipeline.schedule != 'gpipe',
        key,
        'stages of unequal depth run on the 1f1b, interleaved, zbh1 and zbv schedules, not gpipe',
    )


def check_train(config):
    """train.*: batch against the mesh, ramp-up, pipeline fill, cadences, fault drills; fills
    micro_steps."""
    check_values(config, ('train',))
    train = config.train
    replica_batch = _divisible(
        'train.global_batch',
        str(train.global_batch),
        train.global_batch,
        ('train.micro_batch', train.micro_batch),
        ('mesh.data', config.mesh.data),
        *((('mesh.expert', config.mesh.expert),) if config.mesh.expert > 1 else ()),
    )
    train.micro_steps = train.global_batch // replica_batch
    _check_rampup(train, replica_batch)
    _check_pipeline(config, replica_batch)
    xla_options(train)
    _require(
        train.spike_factor == 0 or train.spike_factor > 1,
        'train.spike_factor',
        f'must be 0 (off) or above 1, got {train.spike_factor}',
    )
    _require(
        train.get('straggler_ratio', 1.5) > 1,
        'train.straggler_ratio',
        f'must be above 1 (at most 1 would name every process), got {train.get("straggler_ratio")}',
    )


def check_optimizer(config):
    """optimizer.*; fills decay_tokens (0: the run's tokens) from train.steps and the ramp."""
    check_values(config, ('optimizer',))
    opt, train, model = config.optimizer, config.train, config.model
    _require(
        0 <= opt.min_lr <= opt.lr,
        'optimizer.min_lr',
        f'must be in [0, optimizer.lr={opt.lr}], got {opt.min_lr}',
    )
    if opt.decay_tokens == 0:
        opt.decay_tokens = rampup.total_samples(train, model.seq_len) * model.seq_len
    _require(
        opt.decay_tokens > opt.warmup_tokens,
        'optimizer.decay_tokens',
        f'{opt.decay_tokens} must exceed optimizer.warmup_tokens={opt.warmup_tokens}',
    )


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


def _check_pipeline(config, replica_batch):
    """A known schedule; interleaving needs repeats > 1; GPipe's circular order (repeats > 1)
    needs at least `stage` micro-batches in every step, the smallest batch of a ramp-up
    included (1F1B-family schedules take any count)."""
    stage, repeats, train = config.mesh.stage, config.pipeline.repeats, config.train
    schedule = config.pipeline.schedule
    _require(
        schedule != 'zbh1' or repeats == 1,
        'pipeline.repeats',
        f'zbh1 runs one chunk a stage (pipeline.repeats = 1), got {repeats}',
    )
    _require(
        schedule != 'zbv' or repeats == 2,
        'pipeline.repeats',
        f'zbv runs two chunks a stage in a V (pipeline.repeats = 2), got {repeats}',
    )
    _require(
        schedule != 'interleaved' or repeats > 1,
        'pipeline.schedule',
        'interleaved needs pipeline.repeats > 1 (chunks per stage); with 1 use 1f1b',
    )
    _check_overlap_grad_reduce(config)
    in_flight = config.pipeline.max_in_flight
    _require(
        not in_flight or schedule != 'gpipe',
        'pipeline.max_in_flight',
        'bounds the 1f1b, interleaved, zbh1 and zbv tables; gpipe holds every micro-batch by '
        'design',
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
        f'{stage} micro-batches per step, but {key} / (train.micro_batch x replicas) = '
        f'{smallest} / ({train.micro_batch} x {replicas(config.mesh)}) = '
        f'{smallest // replica_batch}',
    )


def _check_overlap_grad_reduce(config):
    """pipeline.overlap_grad_reduce runs in the 1f1b / interleaved tick by slot, over ZeRO-1's
    axes (the data replicas, and context: parallel/grad_reduce.py), not over expert; without
    stages it has no effect."""
    pipeline, mesh = config.pipeline, config.mesh
    _require(
        not pipeline.get('overlap_param_gather', False)
        or pipeline.get('overlap_grad_reduce', False),
        'pipeline.overlap_param_gather',
        'rides pipeline.overlap_grad_reduce (the engine that takes ZeRO shards): set it too',
    )
    if not pipeline.get('overlap_grad_reduce', False):
        return
    others = [
        name
        for name, on in (
            (
                f'pipeline.schedule = {pipeline.schedule}',
                pipeline.schedule not in ('1f1b', 'interleaved'),
            ),
            ('pipeline.steady_tick', pipeline.steady_tick),
            ('pipeline.fused_accumulation', pipeline.fused_accumulation),
            ('mesh.expert > 1', mesh.expert not in (1,)),
        )
        if on
    ]
    _require(
        not others,
        'pipeline.overlap_grad_reduce',
        'runs in the 1f1b / interleaved tick by slot over the data and context replicas, not '
        'with ' + ', '.join(others),
    )


_XLA_OPTION = re.compile(r'(?:--)?(xla_[A-Za-z0-9_]+)=(\S+)')
_BOOLS = {'true': True, 'false': False}  # XLA_FLAGS' spelling; compiler options take bools


def xla_options(train):
    """{name: value} of train.xla_options, words as in XLA_FLAGS ('--xla_a=1 xla_b=true', the
    `--` optional): true and false as bools, the rest strings for XLA to parse. ConfigError on
    a word that is not xla_NAME=VALUE or a name given twice; whether XLA takes them is the
    compile's to say (mtnlg_jax/xla/options.py asks it first)."""
    options = {}
    for word in str(train.get('xla_options', '')).split():
        match = _XLA_OPTION.fullmatch(word)
        _require(
            match,
            'train.xla_options',
            f'{word!r} is not xla_NAME=VALUE (e.g. xla_gpu_enable_latency_hiding_scheduler=true)',
        )
        _require(match[1] not in options, 'train.xla_options', f'{match[1]} is given twice')
        options[match[1]] = _BOOLS.get(match[2].lower(), match[2])
    return options


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
            f'{ramp[name]} is not divisible by train.micro_batch x replicas = {replica_batch}, '
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
    check_values({'data': data}, ('data',))


def check_packing(config):
    """data.eod_id below the vocabulary."""
    data = config.data
    eod, vocab = data.eod_id, config.model.vocab_size
    _require(
        eod < vocab, 'data.eod_id', f'must be a token id below model.vocab_size={vocab}, got {eod}'
    )
