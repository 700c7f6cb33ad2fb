"""The training loop: one flat function, read top to bottom.

validate data  ->  restore or initialise the state  ->  compile (ahead of time, timed)
for each step:  global batch of the step (ramp-up: its size grows)  ->  train_step
                ->  log / checkpoint / evaluate
                (SIGTERM: save and stop; loss spike: roll back; see faults.py, resume.py)
at the end:     evaluate, write the loss-curve PNG

Several processes run this same loop on their own devices; each reads only its rows of each
batch and writes its shards of each checkpoint. Process 0 alone prints (banner, progress bar,
messages) and writes config.json, metrics.jsonl, tensorboard events and the PNG.
"""

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from mtnlg_jax import checkpoint as checkpoint_lib
from mtnlg_jax import distributed, plan
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.parallel import pipeline
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.rundir import RunDir
from mtnlg_jax.data import rampup
from mtnlg_jax.train import banner, faults, resume
from mtnlg_jax.train import metrics as metrics_lib
from mtnlg_jax.train.state import make_setup, pipeline_order
from mtnlg_jax.train.step import make_eval_step, make_train_step


def open_data(config):
    """Train and validation blends of data.sources; DataError naming the file if unusable
    (launch/train.py checks data.tokenizer against model.vocab_size before this)."""
    datasets = loader_lib.open_datasets(config)
    return datasets['train'], datasets['valid']


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


def done_kills_this_process(config, first_step, done):
    """The process-loss drill (train.inject_kill_at_step): only in a run started from scratch,
    so that the same command, run again, resumes past it."""
    at = config.train.inject_kill_at_step
    return (
        at
        and done == at
        and first_step == 0
        and (jax.process_index() == config.train.inject_kill_process)
    )


def train(config, workdir):
    """Train a resolved config in workdir, resuming from its newest checkpoint if it has one.
    Raises DataError or CheckpointError before anything is written, NonFiniteError after
    train.max_consecutive_skips non-finite steps. Returns the final state."""
    train_data, valid_data = open_data(config)
    mesh = mesh_from_config(config)
    setup = make_setup(config, mesh)
    train_cfg, seq_len = config.train, config.model.seq_len
    replica_batch = train_cfg.micro_batch * config.mesh.data
    num_params = plan.count_params(setup.abstract_state['params'])
    flops_per_token = plan.model_flops_per_token(config.model, num_params)
    peak = plan.device_peak_tflops(jax.devices()[0], config.model.compute_dtype)
    run_dir = RunDir(workdir)
    checkpoints = checkpoint_lib.Checkpoints(workdir, keep=config.checkpoint.keep)
    in_layer_order = pipeline_order(config, setup, to='layer')  # what checkpoints hold
    primary = distributed.is_primary()
    say = print if primary else lambda *_, **__: None

    with jax.set_mesh(mesh), faults.StopSignals() as stop_signals:
        state, counters = resume.restore_or_init(config, setup, checkpoints, log=say)
        os.makedirs(workdir, exist_ok=True)  # every process: checkpoints go under it
        if primary:
            run_dir.write_config(config.to_dict())
        first_step = int(state['step'])
        compiled_steps = {}

        def train_step_for(micro_steps, drill=None):
            """The train step for `micro_steps` (the ramp-up changes it), compiled ahead of
            time once per count; drill: a fault-drill variant (see make_train_step)."""
            if (micro_steps, drill) not in compiled_steps:
                batch = loader_lib.abstract_train_batch(config, mesh, micro_steps)
                lowered = make_train_step(config, setup, inject=drill).lower(
                    state, *batch, jnp.float32(0)
                )
                compiled_steps[micro_steps, drill] = lowered.compile()
            return compiled_steps[micro_steps, drill]

        start = time.perf_counter()
        first_batch = rampup.global_batch_at(train_cfg, seq_len, counters['samples_consumed'])
        train_step_for(first_batch // replica_batch)
        eval_step = make_eval_step(config, setup)
        compile_seconds = time.perf_counter() - start
        for line in banner.lines(config, setup, compile_seconds, train_data):
            say(line, flush=True)
        drills = {train_cfg.inject_spike_at_step: 'spike'}
        first_nan = train_cfg.inject_nan_at_step
        drills.update(
            dict.fromkeys(range(first_nan, first_nan + train_cfg.inject_nan_steps), 'nan')
        )
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
            checkpoints.save(step, in_layer_order(state), resume.checkpoint_meta(config, counters))

        def preempted(step):
            if jax.process_count() > 1:
                return checkpoints.reached_preemption(step)
            return stop_signals.requested

        writer = metrics_lib.MetricsWriter(workdir, resume_step=first_step, enabled=primary)
        progress = tqdm(
            total=train_cfg.steps,
            initial=first_step,
            unit='step',
            mininterval=1.0,
            dynamic_ncols=True,
            disable=not primary,
        )
        write = progress.write if primary else say  # tqdm.write prints even when disabled
        batches = loader_lib.TrainBatches(config, train_data, mesh, counters['samples_consumed'])
        last_time, last_step, last_tokens = time.perf_counter(), first_step, counters['tokens_seen']
        window_losses = []  # device scalars: averaged at the log step, no sync per step
        step = first_step
        while step < train_cfg.steps:
            batch = next(batches)
            if (batch.micro_steps, None) not in compiled_steps:
                start = time.perf_counter()
                train_step_for(batch.micro_steps)
                seconds = time.perf_counter() - start
                last_time += seconds  # compile time is not step time
                write(
                    f'compiled     train step for {batch.micro_steps} micro-steps (global batch '
                    f'{batch.global_batch}) in {seconds:.1f} s'
                )
            drill = drills.pop(step + 1, None)  # once: a rolled-back step is not drilled again
            train_step = train_step_for(batch.micro_steps, drill)
            counters['samples_consumed'] += batch.global_batch
            counters['tokens_seen'] += batch.global_batch * seq_len
            tokens_seen = counters['tokens_seen']
            state, step_metrics = train_step(
                state, batch.tokens, batch.row_ids, jnp.float32(tokens_seen)
            )
            window_losses.append(step_metrics['loss'])
            if done_kills_this_process(config, first_step, step + 1):
                checkpoints.wait()  # the drill loses a process, not the checkpoint before it
                os.kill(os.getpid(), signal.SIGKILL)
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
                    skipped_steps=guard.total,
                    pipeline_bubble_fraction=pipeline.bubble_fraction(
                        config.mesh.stage,
                        config.pipeline.repeats,
                        batch.micro_steps,
                        config.pipeline.schedule,
                    ),
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
                write(
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
                write(
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
                    write(f'loss spike at step {spike_step}: no checkpoint to go back to')
                    continue
                step, state, counters = rolled
                write(
                    f'loss spike at step {spike_step}: {spike_loss:.4f} > '
                    f'{train_cfg.spike_factor} x running mean {mean:.4f}; rolled back to step '
                    f'{step}, data moved on to sample {counters["samples_consumed"]}'
                )
                batches.close()  # the data position moved: read from there
                batches = loader_lib.TrainBatches(
                    config, train_data, mesh, counters['samples_consumed']
                )
                progress.n, window_losses, last_step = step, [], step
                last_tokens = counters['tokens_seen']
        guard.flush()
        batches.close()
        progress.close()
        writer.close()
        checkpoints.wait()  # saves in flight complete, also after non-finite steps
        checkpoints.close()
    if guard.error:
        raise faults.NonFiniteError(guard.error)

    if not primary:
        return state
    png = run_dir.loss_png
    metrics_lib.plot_loss_curve(writer.path, png, title=os.path.basename(workdir.rstrip('/')))
    print(f'wrote {writer.path}, {png} and tensorboard events in {run_dir.tensorboard}')
    return state
