"""The start banner: what will run, where, and what it costs, before the first step."""

import jax

from mtnlg_jax.xla import flags as xla_flags
from mtnlg_jax.model import counts
from mtnlg_jax.model.moe import experts_of
from mtnlg_jax.xla import devices
from mtnlg_jax.parallel import footprint
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax import config as config_lib
from mtnlg_jax.config import rampup


def pipeline_line(config):
    engine, micro = engine_lib.engine(config), config.train.micro_steps
    if not engine.pipelined:
        return engine.name
    return (
        f'{engine.name}, {config.mesh.stage} stages x {config.pipeline.repeats} repeats, '
        f'{micro} micro-batches: {engine.ticks(micro)} ticks, predicted bubble fraction '
        f'{engine.bubble_fraction(micro):.3f}'
    )


def lines(config, setup, compile_seconds, train_data):
    """The start banner: what will run, where, and what it costs."""
    num_params = counts.count_params(setup.layer_abstract_state['params'])
    tokens_per_step = config.train.global_batch * config.model.seq_len
    flops_per_step = counts.model_flops_per_token(config.model, num_params) * tokens_per_step
    held = footprint.bytes_per_device(config, setup)
    mesh = config.mesh
    device = jax.devices()[0]
    return [
        f'model        {num_params / 1e6:.2f} M parameters: {config.model.num_layers} layers, '
        f'hidden {config.model.hidden}, {config.model.heads} heads, seq {config.model.seq_len}, '
        f'vocab {config.model.vocab_size} (padded {config.model.padded_vocab}), '
        f'{config.model.compute_dtype} compute, remat {config.model.remat}',
        f'mesh         data {mesh.data} x stage {mesh.stage} x '
        + (f'context {mesh.context} x ' if mesh.context > 1 else '')
        + f'tensor {mesh.tensor} '
        + (f'x expert {mesh.expert} ' if mesh.expert > 1 else '')
        + f'on {jax.device_count()} x {device.device_kind} ({jax.process_count()} process(es))',
        f'batch        global {config.train.global_batch} = micro_batch {config.train.micro_batch} '
        f'x data {mesh.data} x {config.train.micro_steps} micro-steps; '
        f'{tokens_per_step} tokens per step',
        *experts_lines(config.model, num_params),
        *rampup_lines(config),
        f'per device   parameters {footprint.format_bytes(held["parameters"])}, '
        f'gradients {footprint.format_bytes(held["gradients"])}, '
        f'optimizer {footprint.format_bytes(held["optimizer"])} (ZeRO-1 over {zero_line(mesh)})',
        f'FLOPs        {flops_per_step / 1e12:.3f} TFLOP model FLOPs per step '
        f'(6N + 12LHQT per token{", N active" if experts_of(config.model) else ""}); peak '
        f'{devices.device_peak_tflops(device, config.model.compute_dtype) or "unknown"} TFLOP/s '
        f'per device',
        f'pipeline     {pipeline_line(config)}',
        f'compile      {compile_seconds:.1f} s',
        f'XLA:GPU      {xla_flags.describe()}'
        + (f'; train.xla_options {config.train.xla_options}' if config.train.xla_options else '')
        + (' (no effect on this CPU)' if device.platform == 'cpu' else ''),
        *data_lines(config, train_data),
    ]


def zero_line(mesh):
    """The axes ZeRO-1 shards the optimizer state over (rules.zero_axes): data, and context
    where above 1."""
    return f'data {mesh.data}' + (f' x context {mesh.context}' if mesh.context > 1 else '')


def experts_lines(model_cfg, num_params):
    """The banner's mixture-of-experts line: the routing, and the active parameters (what the
    model FLOPs count) of the total ([] for a dense model)."""
    if not experts_of(model_cfg):
        return []
    moe = model_cfg.moe
    capacity = f'capacity {moe.capacity_factor:g}' if moe.capacity_factor else 'dropless'
    active = counts.active_params(model_cfg, num_params)
    k = moe.dense_layers
    dense = f'; {k} dense layer{"s" if k > 1 else ""} ahead of them' if k else ''
    return [
        f'experts      {moe.experts} routed, top {moe.top_k} ({moe.router} router, {capacity}'
        f'{f", {moe.shared_experts} shared" if moe.shared_experts else ""}){dense}: '
        f'{active / 1e6:.2f} M active of {num_params / 1e6:.2f} M parameters'
    ]


def rampup_lines(config):
    """The banner's ramp-up line, if the config ramps the batch up."""
    train_cfg = config.train
    if not rampup.enabled(train_cfg):
        return []
    ramp = train_cfg.rampup
    replica_batch = train_cfg.micro_batch * config_lib.replicas(config.mesh)
    stages = rampup.stages(train_cfg)
    return [
        f'ramp-up      global batch {ramp.start} -> {train_cfg.global_batch} by {ramp.increment} '
        f'over the first {ramp.tokens:,} tokens: {len(stages)} sizes, micro-steps '
        f'{stages[0] // replica_batch} .. {stages[-1] // replica_batch} (each compiles once)'
    ]


def data_lines(config, train_data):
    """The banner's data lines: the blend and the split, and the sample order."""
    sources = ', '.join(
        f'{weight:g} {prefix} ({dataset.num_tokens:,} train tokens)'
        for (weight, prefix), dataset in zip(config.data.sources, train_data.datasets)
    )
    if config.data.order == 'megatron':
        epochs = ', '.join(str(dataset.epochs) for dataset in train_data.datasets)
        order = (
            f"megatron: Megatron-LM's GPTDataset/BlendedDataset order for this run's "
            f'{rampup.total_samples(config.train, config.model.seq_len):,} train samples '
            f'(epochs per source: {epochs})'
        )
    else:
        order = 'layout_independent: sample i depends on the data, seed and i alone'
    return [f'data         split {config.data.split} of {sources}', f'order        {order}']
