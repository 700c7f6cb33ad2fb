"""The training loop: one flat function, read top to bottom.

validate data  ->  build mesh and state  ->  compile (ahead of time, timed)  ->  banner
for each step:  global batch of the step  ->  train_step  ->  log / evaluate
at the end:     evaluate, write the loss-curve PNG

The batches come from mtnlg_jax/data/loader.py, read ahead by a thread; their size follows
train.rampup, and the train step is compiled once for each micro-step count the ramp reaches.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from mtnlg_jax import checkpoint as checkpoint_lib
from mtnlg_jax import plan
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.data.tokenizer import Tokenizer
from mtnlg_jax.parallel import pipeline
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.train import metrics as metrics_lib
from mtnlg_jax.train import rampup
from mtnlg_jax.train.state import init_state, make_setup
from mtnlg_jax.train.step import make_eval_step, make_train_step


def open_data(config):
    """Train and validation blends of data.sources; DataError naming the file if unusable."""
    datasets = loader_lib.open_datasets(config)
    return datasets['train'], datasets['valid']


def pipeline_line(config):
    stages, repeats, micro = config.mesh.stage, config.pipeline.repeats, config.train.micro_steps
    if stages == 1:
        return 'none (mesh.stage = 1)'
    iterations = pipeline.num_iterations(stages, repeats, micro)
    return (
        f'circular, {stages} stages x {repeats} repeats, {micro} micro-batches: {iterations} '
        f'iterations, bubble fraction (p-1)/(vm+p-1) = '
        f'{pipeline.bubble_fraction(stages, repeats, micro):.3f}'
    )


def banner_lines(config, setup, compile_seconds):
    """The start banner: what will run, where, and what it costs."""
    num_params = plan.count_params(setup.abstract_state['params'])
    tokens_per_step = config.train.global_batch * config.model.seq_len
    flops_per_step = plan.model_flops_per_token(config.model, num_params) * tokens_per_step
    held = plan.bytes_per_device(config, setup)
    mesh = config.mesh
    device = jax.devices()[0]
    return [
        f'model        {num_params / 1e6:.2f} M parameters: {config.model.num_layers} layers, '
        f'hidden {config.model.hidden}, {config.model.heads} heads, seq {config.model.seq_len}, '
        f'vocab {config.model.vocab_size} (padded {config.model.padded_vocab}), '
        f'{config.model.compute_dtype} compute, remat {config.model.remat}',
        f'mesh         data {mesh.data} x stage {mesh.stage} x tensor {mesh.tensor} '
        f'on {jax.device_count()} x {device.device_kind} ({jax.process_count()} process(es))',
        f'batch        global {config.train.global_batch} = micro_batch {config.train.micro_batch} '
        f'x data {mesh.data} x {config.train.micro_steps} micro-steps; '
        f'{tokens_per_step} tokens per step',
        *rampup_lines(config),
        f'per device   parameters {plan.format_bytes(held["parameters"])}, '
        f'gradients {plan.format_bytes(held["gradients"])}, '
        f'optimizer {plan.format_bytes(held["optimizer"])} (ZeRO-1 over data {mesh.data})',
        f'FLOPs        {flops_per_step / 1e12:.3f} TFLOP model FLOPs per step '
        f'(6N + 12LHQT per token); peak '
        f'{plan.device_peak_tflops(device, config.model.compute_dtype) or "unknown"} TFLOP/s '
        f'per device',
        f'pipeline     {pipeline_line(config)}',
        f'compile      {compile_seconds:.1f} s',
    ]


def rampup_lines(config):
    """The banner's ramp-up line, if the config ramps the batch up."""
    train_cfg = config.train
    if not rampup.enabled(train_cfg):
        return []
    ramp, replica_batch = train_cfg.rampup, train_cfg.micro_batch * config.mesh.data
    stages = rampup.stages(train_cfg)
    return [
        f'ramp-up      global batch {ramp.start} -> {train_cfg.global_batch} by {ramp.increment} '
        f'over the first {ramp.tokens:,} tokens: {len(stages)} sizes, micro-steps '
        f'{stages[0] // replica_batch} .. {stages[-1] // replica_batch} (each compiles once)'
    ]


def data_lines(config, train_data):
    """The banner's data line: the blend and the split."""
    sources = ', '.join(
        f'{weight:g} {prefix} ({dataset.num_tokens:,} train tokens)'
        for (weight, prefix), dataset in zip(config.data.sources, train_data.datasets)
    )
    return [f'data         split {config.data.split} of {sources}']


def evaluate(config, eval_step, params, dataset, mesh):
    """Mean validation loss over `train.eval_batches` fixed global batches of the validation
    split, laid out in micro-batches as a train step's (the pipeline needs them so)."""
    size, micro_steps = config.train.global_batch, config.train.micro_steps
    loss_sum, count = 0.0, 0.0
    for i in range(config.train.eval_batches):
        tokens, _ = loader_lib.place_train_batch(dataset, mesh, i * size, size, micro_steps)
        batch_loss, batch_count = eval_step(params, tokens)
        loss_sum, count = loss_sum + float(batch_loss), count + float(batch_count)
    return loss_sum / count


def restore_or_init(config, setup, checkpoints):
    """The newest checkpoint of the workdir, resharded onto this layout, or a fresh state.
    Returns (state, counters) with counters = samples_consumed and tokens_seen."""
    if checkpoints.latest_step() is None:
        return init_state(config, setup), dict(samples_consumed=0, tokens_seen=0)
    abstract = checkpoint_lib.abstract_with_shardings(setup.abstract_state, setup.state_shardings)
    state, meta = checkpoints.restore(abstract)
    state = pipeline_order(config, setup, to='schedule')(state)  # stored in layer order
    return state, {key: meta[key] for key in ('samples_consumed', 'tokens_seen')}


def pipeline_order(config, setup, to):
    """A jitted state -> state that moves block parameters and moments between plain layer
    order (what checkpoints hold) and the pipeline's stage-major order (what a stage holds).
    The identity, with nothing moved, unless the schedule has both stages and repeats."""
    if config.mesh.stage == 1 or config.pipeline.repeats == 1:
        return lambda state: state
    convert = pipeline.to_layer_order if to == 'layer' else pipeline.to_schedule_order
    shape = (config.model.num_layers, config.mesh.stage, config.pipeline.repeats)
    return jax.jit(lambda state: convert(state, *shape), out_shardings=setup.state_shardings)


def checkpoint_meta(config, counters):
    """What a checkpoint needs besides the arrays to resume exactly."""
    tokenizer = None
    if os.path.exists(config.data.tokenizer):
        tokenizer = Tokenizer(config.data.tokenizer).identity
    return dict(counters, config=config.to_dict(), tokenizer_identity=tokenizer)


def train(config, workdir):
    """Train a resolved config in workdir, resuming from its newest checkpoint if it has one.
    Raises DataError before anything is written."""
    train_data, valid_data = open_data(config)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
        json.dump(config.to_dict(), f, indent=2)

    mesh = mesh_from_config(config)
    setup = make_setup(config, mesh)
    train_cfg, seq_len = config.train, config.model.seq_len
    num_params = plan.count_params(setup.abstract_state['params'])
    flops_per_token = plan.model_flops_per_token(config.model, num_params)
    peak = plan.device_peak_tflops(jax.devices()[0], config.model.compute_dtype)
    checkpoints = checkpoint_lib.Checkpoints(workdir, keep=config.checkpoint.keep)

    with jax.set_mesh(mesh):
        state, counters = restore_or_init(config, setup, checkpoints)
        first_step = int(state['step'])
        make_step, train_steps = make_train_step(config, setup), {}

        def train_step_for(micro_steps):
            """The train step compiled ahead of time for `micro_steps`, once per count."""
            if micro_steps not in train_steps:
                batch = loader_lib.abstract_train_batch(config, mesh, micro_steps)
                train_steps[micro_steps] = make_step.lower(state, *batch, jnp.float32(0)).compile()
            return train_steps[micro_steps]

        start = time.perf_counter()
        first_batch = rampup.global_batch_at(train_cfg, seq_len, counters['samples_consumed'])
        train_step_for(first_batch // (train_cfg.micro_batch * config.mesh.data))
        eval_step = make_eval_step(config, setup)
        in_layer_order = pipeline_order(config, setup, to='layer')
        compile_seconds = time.perf_counter() - start
        for line in banner_lines(config, setup, compile_seconds) + data_lines(config, train_data):
            print(line, flush=True)
        if first_step:
            print(f'resumed      from step {first_step} of {checkpoints.directory}', flush=True)

        writer = metrics_lib.MetricsWriter(workdir, resume_step=first_step)
        progress = tqdm(
            total=train_cfg.steps,
            initial=first_step,
            unit='step',
            mininterval=1.0,
            dynamic_ncols=True,
        )
        batches = loader_lib.TrainBatches(config, train_data, mesh, counters['samples_consumed'])
        last_time, last_step, last_tokens = time.perf_counter(), first_step, counters['tokens_seen']
        window_losses = []  # device scalars: averaged at the log step, no sync per step
        for step in range(first_step, train_cfg.steps):
            batch = next(batches)
            if batch.micro_steps not in train_steps:
                start = time.perf_counter()
                train_step_for(batch.micro_steps)
                seconds = time.perf_counter() - start
                last_time += seconds  # compile time is not step time
                progress.write(
                    f'compiled     train step for {batch.micro_steps} micro-steps (global batch '
                    f'{batch.global_batch}) in {seconds:.1f} s'
                )
            train_step = train_step_for(batch.micro_steps)
            counters['samples_consumed'] += batch.global_batch
            counters['tokens_seen'] += batch.global_batch * seq_len
            tokens_seen = counters['tokens_seen']
            state, step_metrics = train_step(
                state, batch.tokens, batch.row_ids, jnp.float32(tokens_seen)
            )
            window_losses.append(step_metrics['loss'])
            progress.update(1)
            done = step + 1
            if done % train_cfg.log_every == 0 or done == train_cfg.steps:
                step_metrics, losses = jax.device_get((step_metrics, window_losses))
                window_losses = []
                now = time.perf_counter()
                step_time = (now - last_time) / (done - last_step)
                tokens_per_s = (tokens_seen - last_tokens) / (now - last_time)
                last_time, last_step, last_tokens = now, done, tokens_seen
                tflops = flops_per_token * tokens_per_s / jax.device_count() / 1e12
                record = dict(
                    step=done,
                    loss=float(np.mean(losses)),  # mean over the log interval
                    lr=float(step_metrics['lr']),
                    grad_norm=float(step_metrics['grad_norm']),
                    global_batch=batch.global_batch,
                    tokens_seen=tokens_seen,
                    step_time_s=step_time,
                    tokens_per_s=tokens_per_s,
                    tflops_per_device=tflops,
                    mfu=tflops / peak if peak else None,
                    pipeline_bubble_fraction=pipeline.bubble_fraction(
                        config.mesh.stage, config.pipeline.repeats, batch.micro_steps
                    ),
                )
                writer.write(record)
                progress.set_postfix(
                    loss=f'{record["loss"]:.3f}',
                    tok_s=f'{tokens_per_s:,.0f}',
                    mfu='n/a' if peak is None else f'{record["mfu"]:.1%}',
                )
            every = config.checkpoint.every
            if (every and done % every == 0) or done == train_cfg.steps:
                checkpoints.save(done, in_layer_order(state), checkpoint_meta(config, counters))
            if (
                train_cfg.eval_every and done % train_cfg.eval_every == 0
            ) or done == train_cfg.steps:
                loss = evaluate(config, eval_step, state['params'], valid_data, mesh)
                writer.write(
                    dict(
                        step=done,
                        eval=True,
                        loss=loss,
                        tokens_seen=tokens_seen,
                        perplexity=metrics_lib.perplexity(loss),
                    )
                )
                progress.write(
                    f'step {done}: validation loss {loss:.4f}, '
                    f'perplexity {metrics_lib.perplexity(loss):.2f}'
                )
                last_time = time.perf_counter()  # evaluation time is not step time
        batches.close()
        progress.close()
        writer.close()
        checkpoints.wait()
        checkpoints.close()

    png = os.path.join(workdir, 'loss.png')
    metrics_lib.plot_loss_curve(writer.path, png, title=os.path.basename(workdir.rstrip('/')))
    print(f'wrote {writer.path}, {png} and tensorboard events in {workdir}/tensorboard')
    return state
