"""The training loop: one flat function, read top to bottom.

validate data  ->  build mesh and state  ->  compile (ahead of time, timed)  ->  banner
for each step:  global batch of the step  ->  train_step  ->  log / checkpoint / evaluate
                (SIGTERM: save and stop; loss spike: roll back; see faults.py, resume.py)
at the end:     evaluate, write the loss-curve PNG
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
from mtnlg_jax.data.loader import TokenWindowLoader, read_token_file
from mtnlg_jax.parallel import rules
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.train import faults, resume
from mtnlg_jax.train import metrics as metrics_lib
from mtnlg_jax.train.state import make_setup
from mtnlg_jax.train.step import (
    BATCH_AXES,
    make_eval_step,
    make_train_step,
    place_batch,
    to_micro_steps,
)


class DataConfigError(ValueError):
    """Training data that does not fit the config; the message names the file or key."""


def open_data(config):
    """Train and validation loaders of `data.path`, checked against the model's vocabulary."""
    loaders = {}
    for split in ('train', 'valid'):
        path = os.path.join(config.data.path, f'{split}.npy')
        if not os.path.exists(path):
            raise DataConfigError(
                f'{path} not found (data.path={config.data.path!r}; '
                f'`make data` prepares the default corpus)'
            )
        tokens = read_token_file(path)
        if tokens.size and int(tokens.max()) >= config.model.vocab_size:
            raise DataConfigError(
                f'{path} holds token id {int(tokens.max())}, but '
                f'model.vocab_size={config.model.vocab_size}'
            )
        loaders[split] = TokenWindowLoader(tokens, config.model.seq_len, config.train.seed)
    return loaders['train'], loaders['valid']


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
        f'per device   parameters {plan.format_bytes(held["parameters"])}, '
        f'gradients {plan.format_bytes(held["gradients"])}, '
        f'optimizer {plan.format_bytes(held["optimizer"])} (ZeRO-1 over data {mesh.data})',
        f'FLOPs        {flops_per_step / 1e12:.3f} TFLOP model FLOPs per step '
        f'(6N + 12LHQT per token); peak '
        f'{plan.device_peak_tflops(device, config.model.compute_dtype) or "unknown"} TFLOP/s '
        f'per device',
        f'compile      {compile_seconds:.1f} s',
    ]


def evaluate(config, eval_step, params, loader, mesh):
    """Mean validation loss over `train.eval_batches` fixed batches of the validation split."""
    rows = config.train.global_batch // config.train.micro_steps
    sharding = jax.sharding.NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES[1:]))
    loss_sum, count = 0.0, 0.0
    for i in range(config.train.eval_batches):
        batch = loader.samples(i * rows, rows)
        tokens = jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])
        batch_loss, batch_count = eval_step(params, tokens)
        loss_sum, count = loss_sum + float(batch_loss), count + float(batch_count)
    return loss_sum / count


def restore_or_init(config, setup, checkpoints):
    """The newest usable checkpoint of the workdir (or of checkpoint.init_from), resharded
    onto this layout, or a fresh state. Returns (state, counters); see train/resume.py."""
    return resume.restore_or_init(config, setup, checkpoints)


checkpoint_meta = resume.checkpoint_meta


def train(config, workdir):
    """Train a resolved config in workdir, resuming from its newest checkpoint if it has one.
    Raises DataConfigError or CheckpointError before anything is written, NonFiniteError
    after train.max_consecutive_skips non-finite steps. Returns the final state."""
    train_data, valid_data = open_data(config)
    mesh = mesh_from_config(config)
    setup = make_setup(config, mesh)
    train_cfg, seq_len = config.train, config.model.seq_len
    num_params = plan.count_params(setup.abstract_state['params'])
    flops_per_token = plan.model_flops_per_token(config.model, num_params)
    peak = plan.device_peak_tflops(jax.devices()[0], config.model.compute_dtype)
    checkpoints = checkpoint_lib.Checkpoints(workdir, keep=config.checkpoint.keep)

    def next_batch(samples_consumed):
        host_batch = train_data.samples(samples_consumed, train_cfg.global_batch)
        return place_batch(*to_micro_steps(host_batch, train_cfg.micro_steps), mesh)

    with jax.set_mesh(mesh), faults.StopSignals() as stop_signals:
        state, counters = restore_or_init(config, setup, checkpoints)
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, 'config.json'), 'w') as f:
            json.dump(config.to_dict(), f, indent=2)
        first_step = int(state['step'])
        start = time.perf_counter()
        train_step = make_train_step(config, setup)
        train_step = train_step.lower(state, *next_batch(0), jnp.float32(0)).compile()
        eval_step = make_eval_step(config, setup)
        compile_seconds = time.perf_counter() - start
        for line in banner_lines(config, setup, compile_seconds):
            print(line, flush=True)
        drills = {train_cfg.inject_spike_at_step: 'spike'}
        first_nan = train_cfg.inject_nan_at_step
        drills.update(
            dict.fromkeys(range(first_nan, first_nan + train_cfg.inject_nan_steps), 'nan')
        )
        drill_steps = {
            kind: make_train_step(config, setup, inject=kind) for kind in ('nan', 'spike')
        }
        guard = faults.StepGuard(
            train_cfg.max_consecutive_skips,
            train_cfg.spike_factor,
            train_cfg.spike_window,
            counters['skipped_steps'],
        )

        def save(step):
            guard.flush()
            if guard.error or guard.spike:  # keep the last good checkpoint
                return
            counters['skipped_steps'] = guard.total
            checkpoints.save(step, state, checkpoint_meta(config, counters))

        def preempted(step):
            if jax.process_count() > 1:
                return checkpoints.reached_preemption(step)
            return stop_signals.requested

        writer = metrics_lib.MetricsWriter(workdir, resume_step=first_step)
        progress = tqdm(
            total=train_cfg.steps,
            initial=first_step,
            unit='step',
            mininterval=1.0,
            dynamic_ncols=True,
        )
        last_time, last_step = time.perf_counter(), first_step
        window_losses = []  # device scalars: averaged at the log step, no sync per step
        step = first_step
        while step < train_cfg.steps:
            tokens, row_ids = next_batch(counters['samples_consumed'])
            counters['samples_consumed'] += train_cfg.global_batch
            counters['tokens_seen'] += train_cfg.global_batch * seq_len
            tokens_seen = counters['tokens_seen']
            drill = drills.pop(step + 1, None)  # once: a rolled-back step is not drilled again
            step_fn = drill_steps[drill] if drill else train_step
            state, step_metrics = step_fn(state, tokens, row_ids, jnp.float32(tokens_seen))
            window_losses.append(step_metrics['loss'])
            progress.update(1)
            done = step + 1
            guard.push(done, step_metrics)
            stopping = preempted(done)
            if done % train_cfg.log_every == 0 or done == train_cfg.steps or stopping:
                guard.flush()
                step_metrics, losses = jax.device_get((step_metrics, window_losses))
                window_losses = []
                now = time.perf_counter()
                step_time = (now - last_time) / (done - last_step)
                last_time, last_step = now, done
                tokens_per_s = train_cfg.global_batch * seq_len / step_time
                tflops = flops_per_token * tokens_per_s / jax.device_count() / 1e12
                record = dict(
                    step=done,
                    loss=float(np.mean(losses)),  # mean over the log interval
                    lr=float(step_metrics['lr']),
                    grad_norm=float(step_metrics['grad_norm']),
                    global_batch=train_cfg.global_batch,
                    tokens_seen=tokens_seen,
                    step_time_s=step_time,
                    tokens_per_s=tokens_per_s,
                    tflops_per_device=tflops,
                    mfu=tflops / peak if peak else None,
                    skipped_steps=guard.total,
                )
                writer.write(record)
                progress.set_postfix(
                    loss=f'{record["loss"]:.3f}',
                    tok_s=f'{tokens_per_s:,.0f}',
                    mfu='n/a' if peak is None else f'{record["mfu"]:.1%}',
                )
            every = config.checkpoint.every
            if (every and done % every == 0) or done == train_cfg.steps or stopping:
                save(done)
            if guard.error:
                break
            if stopping:
                progress.write(
                    f'stopped      at step {done} on request: checkpoint saved; '
                    f'the same command resumes it'
                )
                break
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
            step = done
            if guard.spike:
                rolled = resume.roll_back(config, setup, checkpoints, counters)
                spike_step, spike_loss, mean = guard.spike
                guard.spike = None
                if rolled is None:
                    progress.write(f'loss spike at step {spike_step}: no checkpoint to go back to')
                    continue
                step, state, counters = rolled
                progress.write(
                    f'loss spike at step {spike_step}: {spike_loss:.4f} > '
                    f'{train_cfg.spike_factor} x running mean {mean:.4f}; rolled back to step '
                    f'{step}, data moved on to sample {counters["samples_consumed"]}'
                )
                progress.n, window_losses, last_step = step, [], step
        guard.flush()
        progress.close()
        writer.close()
        checkpoints.wait()  # saves in flight complete, also after non-finite steps
        checkpoints.close()
    if guard.error:
        raise faults.NonFiniteError(guard.error)

    png = os.path.join(workdir, 'loss.png')
    metrics_lib.plot_loss_curve(writer.path, png, title=os.path.basename(workdir.rstrip('/')))
    print(f'wrote {writer.path}, {png} and tensorboard events in {workdir}/tensorboard')
    return state
