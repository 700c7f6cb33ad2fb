"""The config: every input key with its default, what is derived, and resolve() that runs
the check of each section (checks.py).

Experiment files (configs/*.py) start from `defaults()` and change a few keys; every tool that
takes a config accepts any key on the command line as `--config.KEY=VALUE` (mtnlg_jax/run/cli.py).
`resolve()` checks each section against the device count before anything is built and derives
what follows from the inputs:

  mesh.{data,stage,tensor}  -1 filled with the devices the other axes leave
  model.ffn_hidden          0 -> 4 x hidden
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

from mtnlg_jax.config.checks import (
    _require,
    check_checkpoint,
    check_data,
    check_model,
    check_optimizer,
    check_train,
)


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
            # auto | fused | flash | plain (model/block.py). No (seq x seq) scores in memory
            # on the fused kernels: cuDNN's flash attention (jax.nn.dot_product_attention; a
            # GPU, bf16/fp16, no attention dropout, head dim <= 128 on A100, 256 on H100) and
            # the Pallas flash kernel (model/flash_attention.py; Triton on GPUs, bf16/fp16,
            # head dim <= 256, attention dropout from per-sequence keys). auto: cuDNN, else
            # flash, else plain; fused: the same, refused where neither runs; flash: the
            # Pallas kernel (interpreted on a CPU); plain: einsums around the fp32 scores.
            attention='auto',
            # Megatron's sequence parallelism: layer norms, dropout and residual adds on
            # sequence shards split over mesh.tensor (parallel/rules.py).
            sequence_parallel=False,
            # The output layer and loss run over this many pieces of the sequence, each
            # piece's logits made and dropped in turn with the gradients (model/loss.py);
            # 0: the largest of 4, 3, 2, 1 that divides seq_len.
            loss_chunks=0,
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
            # Progress watchdog (train/watchdog.py): a batch, step, evaluation or save that
            # takes longer than its allowance ends the process with its stacks in its log
            # (exit status 3). Allowance: hang_timeout_s seconds if > 0, else
            # max(hang_floor_s, 10 x the slowest of its kind so far); restores and compiles
            # are not watched.
            hang_timeout_s=0,
            hang_floor_s=300,
            # Fault drills, to check on a real cluster what a bad step does (0: never): steps
            # inject_nan_at_step .. + inject_nan_steps - 1 get a NaN loss and gradients;
            # step inject_spike_at_step reports 10 x its loss; in a run started from scratch
            # (not resumed), at step inject_kill_at_step process inject_kill_process kills
            # itself (SIGKILL, a lost node): the others must end within
            # distributed.heartbeat_timeout_s, and the same command resumes; at step
            # inject_hang_at_step process inject_hang_process stops making progress (a
            # deadlocked data reader) until its watchdog ends it.
            inject_nan_at_step=0,
            inject_nan_steps=1,
            inject_spike_at_step=0,
            inject_kill_at_step=0,
            inject_kill_process=0,
            inject_hang_at_step=0,
            inject_hang_process=0,
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
    # on_save_error: stop (a failed save ends the run, exit status 1) or continue (a warning;
    # the run goes on and saves again at the next checkpoint). inject_save_error_at_step: a
    # drill, the save of that step fails as on a full disk (in every run that saves it).
    config.checkpoint = ml_collections.ConfigDict(
        dict(
            every=0,
            keep=3,
            init_from='',
            init_full_state=False,
            on_save_error='stop',
            inject_save_error_at_step=0,
        )
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
    # Several processes (mtnlg_jax/run/distributed.py): one that sends no heartbeat for
    # heartbeat_timeout_s ends them all (JAX's default of 100 s leaves survivors hanging);
    # the others wait up to initialization_timeout_s for process 0 to start.
    config.distributed = ml_collections.ConfigDict(
        dict(heartbeat_timeout_s=30, initialization_timeout_s=300)
    )
    return config


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


DERIVED_KEYS = (
    'mesh.data',
    'mesh.stage',
    'mesh.tensor',
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
