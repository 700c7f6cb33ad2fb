"""What a run writes for people to read: metrics.jsonl, tensorboard events, a loss-curve PNG.

metrics.jsonl holds one JSON object per logged step (`step`, `loss` (the mean over the steps
since the last record, as Megatron logs it), `lr`, `grad_norm`,
`global_batch`, `tokens_seen`, `step_time_s`, `tokens_per_s`, `tflops_per_device`, `mfu`,
`skipped_steps`, `pipeline_bubble_fraction`; a mixture of experts adds `moe_aux_loss`,
`moe_z_loss`, `moe_load_max_over_mean` (the largest over layers), the per-layer
`moe_layer_load_max_over_mean` (tensorboard: .../layer_N) and `moe_dropped_fraction`; runs of
several processes add `relative_speed`, one number per process, and `straggler_check_s`, what
the last comparison cost (stragglers.py); train/loop.py's step_record builds it) and one per
evaluation (`"eval": true`, `step`, `loss`, `perplexity`).
"""

import contextlib
import errno
import json
import math
import os
import sys

from tensorboardX import SummaryWriter
from tqdm import tqdm

from mtnlg_jax.run import storage
from mtnlg_jax.run.rundir import RunDir


class MetricsWriter:
    """Appends records to metrics.jsonl and mirrors their numbers to tensorboard. A write the
    storage refuses (a full disk) is one warning line and the end of writing: `failed` holds
    the message the run ends with (the run itself goes on to its next checkpoint, which on
    the same full disk stops it)."""

    def __init__(self, workdir, resume_step=0, enabled=True):
        """Records past `resume_step` are dropped: a resumed run computes them again.
        enabled=False (every process but process 0 of a run): writes nothing."""
        run_dir = RunDir(workdir)
        self.path = run_dir.metrics
        self.enabled = enabled
        self.failed = None
        if not enabled:
            return
        storage.quiet_background_noise()  # tensorboard's writer thread on a full disk
        if os.path.exists(self.path):
            kept = [r for r in read_metrics(self.path) if r['step'] <= resume_step]
            with open(self.path + '.tmp', 'w') as f:
                f.writelines(json.dumps(r) + '\n' for r in kept)
            os.replace(self.path + '.tmp', self.path)
        self._file = open(self.path, 'a')
        self._tensorboard = SummaryWriter(run_dir.tensorboard)

    def write(self, record):
        if not self.enabled or self.failed:
            return
        with self._refusals_named():
            self._file.write(json.dumps(record) + '\n')
            self._file.flush()
            prefix = 'eval' if record.get('eval') else 'train'
            for key, value in record.items():
                if (
                    key not in ('step', 'eval')
                    and isinstance(value, (int, float))
                    and value is not None
                ):
                    self._check_tensorboard()
                    self._tensorboard.add_scalar(f'{prefix}/{key}', value, record['step'])
                elif isinstance(value, list):  # one number per process or per layer
                    for index, number in enumerate(value):
                        self._check_tensorboard()
                        self._tensorboard.add_scalar(f'{prefix}/{key}/{list_item(key)}_{index}',
                                                     number, record['step'])  # fmt: skip

    def close(self):
        if not self.enabled:
            return
        closes = [self._file.close] + [self._tensorboard.close] * self._tensorboard_alive()
        for close in closes:
            with self._refusals_named():
                close()

    def _tensorboard_alive(self):
        """Whether tensorboardX's writer thread still runs: once a full disk ended it, its
        queue fills and the next event would block forever."""
        writer = getattr(getattr(self._tensorboard, 'file_writer', None), 'event_writer', None)
        worker = getattr(writer, '_worker', None)
        return worker is None or worker.is_alive()

    def _check_tensorboard(self):
        if not self._tensorboard_alive():
            raise storage.refused_in_background() or OSError(
                errno.EIO, 'tensorboard writer thread ended'
            )

    @contextlib.contextmanager
    def _refusals_named(self):
        try:
            yield
        except OSError as error:
            refused = storage.refusal(error)
            if refused is None:
                raise
            # Its writer thread ended (a live one is asked to end: left in its queue's wait it
            # fails when the queue closes at exit); tensorboardX skips its writes, flushes and
            # its close at exit once closed.
            writer = getattr(getattr(self._tensorboard, 'file_writer', None), 'event_writer', None)
            if writer is not None:
                if not writer._closed and writer._worker.is_alive():
                    writer._worker.stop()
                writer._closed = True
            if self.failed is None:
                self.failed = storage.noted(
                    f'{self.path} (or its tensorboard events) not written from here on: '
                    f'{refused}; {storage.free_space(self.path)}'
                )
                tqdm.write(f'warning: {self.failed}', sys.stderr)


def list_item(key):
    """What each number of a record's list is (tensorboard's tag): a layer's (the MoE's
    per-layer loads) or a process's (relative_speed)."""
    return 'layer' if key.startswith('moe_layer_') else 'process'


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(metrics_path, png_path, title=''):
    """Training and validation loss against tokens seen, saved as a PNG. Matplotlib is
    imported here, by the one process that plots at a run's end (0.3 s of every train
    process's start-up before: the others', and a run that fails, never plot)."""
    from matplotlib.figure import Figure  # noqa: PLC0415 (no pyplot: no display, no state)

    records = read_metrics(metrics_path)
    train = [r for r in records if not r.get('eval')]
    evals = [r for r in records if r.get('eval')]
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    ax.plot([r['tokens_seen'] for r in train], [r['loss'] for r in train], label='train')
    if evals:
        ax.plot(
            [r['tokens_seen'] for r in evals], [r['loss'] for r in evals], 'o-', label='validation'
        )
    ax.set_xlabel('tokens seen')
    ax.set_ylabel('loss (nats / token)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)


def perplexity(loss):
    return math.exp(loss) if loss < 50 else float('inf')
