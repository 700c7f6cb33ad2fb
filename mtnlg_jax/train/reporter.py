"""What a training run shows and writes as it goes (train/loop.py's Reporter): the progress bar
and messages, metrics.jsonl and tensorboard (process 0 only), and the throughput of each
logged interval, less compile and evaluation time.
"""

import time

import jax
import numpy as np
from tqdm import tqdm

from mtnlg_jax.run import distributed
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.train import metrics as metrics_lib


class Interval:
    """Wall time and tokens since the last logged step, less compile and evaluation time."""

    def __init__(self, step, tokens):
        self.reset(step, tokens)

    def reset(self, step, tokens):
        self.start, self.step, self.tokens = time.perf_counter(), step, tokens

    def exclude(self, seconds):
        self.start += seconds

    def close(self, step, tokens):
        """(seconds per step, tokens per second) up to `step`, and start the next interval."""
        seconds = time.perf_counter() - self.start
        rates = seconds / (step - self.step), (tokens - self.tokens) / seconds
        self.reset(step, tokens)
        return rates


def step_record(config, position, batch, losses, step_metrics, throughput):
    """The metrics.jsonl record of a logged step (see metrics.py for the keys); `losses`: the
    losses since the last record; throughput: (Interval.close's rates, model FLOPs per token,
    the device's peak TFLOP/s or None)."""
    (step_time, tokens_per_s), flops_per_token, peak = throughput
    tflops = flops_per_token * tokens_per_s / jax.device_count() / 1e12
    return dict(
        step=position.step,
        loss=float(np.mean(losses)),  # mean over the log interval
        lr=float(step_metrics['lr']),
        grad_norm=float(step_metrics['grad_norm']),
        global_batch=batch.global_batch,
        tokens_seen=position.counters['tokens_seen'],
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        tflops_per_device=tflops,
        mfu=tflops / peak if peak else None,
        skipped_steps=position.counters['skipped_steps'],
        pipeline_bubble_fraction=engine_lib.engine(config).bubble_fraction(batch.micro_steps),
        **moe_record(step_metrics),
    )


def moe_record(step_metrics):
    """A mixture of experts' fields of the record, from the logged step's side values
    (model/moe.py; none for a dense model): its aux and z losses per token, each layer's
    largest expert load over the mean (1: balanced), their largest, and the share of the
    choices capacity dropped."""
    if 'moe_loads' not in step_metrics:
        return {}
    loads = np.asarray(step_metrics['moe_loads'], np.float64)  # (layers, experts)
    imbalance = loads.max(-1) / np.maximum(loads.mean(-1), 1e-30)
    return dict(
        moe_aux_loss=float(step_metrics['moe_aux_loss']),
        moe_z_loss=float(step_metrics['moe_z_loss']),
        moe_load_max_over_mean=float(imbalance.max()),
        moe_layer_load_max_over_mean=[round(float(x), 4) for x in imbalance],
        moe_dropped_fraction=float(step_metrics['moe_dropped']) / max(float(loads.sum()), 1.0),
    )


def moe_postfix(record):
    """The progress bar's MoE fields of a record: the largest layer's expert load over the
    mean and the dropped share ({} for a dense model)."""
    if 'moe_load_max_over_mean' not in record:
        return {}
    return dict(
        load=f'{record["moe_load_max_over_mean"]:.2f}', drop=f'{record["moe_dropped_fraction"]:.1%}'
    )


def moe_line(record):
    """A logged step's MoE line: every layer's largest expert load over the mean, the aux loss
    and the dropped share (None for a dense model)."""
    if 'moe_layer_load_max_over_mean' not in record:
        return None
    loads = ' '.join(f'{x:.2f}' for x in record['moe_layer_load_max_over_mean'])
    return (
        f'step {record["step"]}: expert load max / mean by layer {loads}; aux loss '
        f'{record["moe_aux_loss"]:.4f}, dropped {record["moe_dropped_fraction"]:.2%}'
    )


class Reporter:
    """What a run shows and writes as it goes: the progress bar and messages, metrics.jsonl
    and tensorboard (process 0 only), and the throughput of each logged interval."""

    def __init__(self, config, workdir, position, flops_per_token, peak):
        self.config, self.flops_per_token, self.peak = config, flops_per_token, peak
        primary = distributed.is_primary()
        self.writer = metrics_lib.MetricsWriter(workdir, resume_step=position.step, enabled=primary)
        self.progress = tqdm(
            total=config.train.steps,
            initial=position.step,
            unit='step',
            mininterval=1.0,
            dynamic_ncols=True,
            disable=not primary,
        )
        self.say = self.progress.write if primary else lambda *_, **__: None
        self.interval = Interval(position.step, position.counters['tokens_seen'])
        self.losses = []  # device scalars: averaged at the log step, no sync per step
        # (every process's relative speed, the seconds the comparison took) at the last
        # comparison of the processes (stragglers.py), or None
        self.relative_speed = None, None

    def say_everywhere(self, message):
        """A line from every process: process 0's on the terminal, the others' in their logs."""
        if distributed.is_primary():
            self.say(message)
        else:
            print(message, flush=True)

    def compiled(self, batch, seconds):
        self.interval.exclude(seconds)  # compile time is not step time
        self.say(
            f'compiled     train step for {batch.micro_steps} micro-steps (global batch '
            f'{batch.global_batch}) in {seconds:.1f} s'
        )

    def stepped(self, step_metrics):
        self.losses.append(step_metrics['loss'])
        self.progress.update(1)

    def log(self, position, batch, step_metrics):
        step_metrics, losses = jax.device_get((step_metrics, self.losses))
        self.losses = []
        rates = self.interval.close(position.step, position.counters['tokens_seen'])
        throughput = rates, self.flops_per_token, self.peak
        record = step_record(self.config, position, batch, losses, step_metrics, throughput)
        speeds, cost = self.relative_speed
        if speeds is not None:
            record.update(relative_speed=speeds, straggler_check_s=cost)
        self.writer.write(record)
        self.progress.set_postfix(
            loss=f'{record["loss"]:.3f}',
            tok_s=f'{record["tokens_per_s"]:,.0f}',
            mfu='n/a' if self.peak is None else f'{record["mfu"]:.1%}',
            **moe_postfix(record),
        )
        line = moe_line(record)
        every = self.config.train.eval_every or self.config.train.steps
        if line and position.step % every == 0:  # beside the validation loss's line
            self.say(line)

    def evaluated(self, position, loss, seconds):
        perplexity = metrics_lib.perplexity(loss)
        self.writer.write(
            dict(
                step=position.step,
                eval=True,
                loss=loss,
                tokens_seen=position.counters['tokens_seen'],
                perplexity=perplexity,
            )
        )
        self.say(f'step {position.step}: validation loss {loss:.4f}, perplexity {perplexity:.2f}')
        self.interval.exclude(seconds)  # evaluation is not step time

    def moved_to(self, position):
        """After a rollback: the bar and the interval start again at `position`."""
        self.progress.n, self.losses = position.step, []
        self.interval.reset(position.step, position.counters['tokens_seen'])

    def close(self):
        self.progress.close()
        self.writer.close()
        return self.writer.path
