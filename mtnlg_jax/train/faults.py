"""Faults a long run must survive: preemption signals, non-finite steps, failed saves, and
the drills that rehearse them (docs/faults.md says what each looks like to a user).

Preemption: SIGTERM (what schedulers send before they kill) or SIGINT (Ctrl-C) sets a flag;
the loop finishes the step it is on, saves, and exits 0. A second SIGINT interrupts at once.
Multi-process runs ask orbax instead (`Checkpoints.reached_preemption`), so that every
process stops at the same step: there SIGTERM is left to JAX's preemption notifier (which
jax.distributed installed), and SIGINT is passed on to it as SIGTERM.

Loss spikes (optional, as PaLM did): a loss above train.spike_factor x the running mean of
the last train.spike_window losses rolls the run back to its newest checkpoint and moves the
data past the spike and train.spike_skip_batches more batches (see resume.roll_back).

Non-finite steps: the train step itself keeps the old parameters and optimizer state when
the loss or the gradient norm is NaN or Inf (jnp.where inside the jitted step) and reports
`skipped`. The host reads that flag (and the loss) one step late, while the next step
already runs, so watching never stalls the device:

    dispatch step n  ->  read skipped of step n-1  ->  dispatch step n+1  -> ...
"""

import collections
import os
import signal
import time

import jax


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops, its checkpoints untouched."""


class SaveFailedError(RuntimeError):
    """A checkpoint could not be written (checkpoint.on_save_error=stop): the run stops, its
    newest complete checkpoint untouched."""


class StopSignals:
    """Context manager: while inside, SIGTERM and SIGINT request a stop instead of killing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        if jax.process_count() > 1:  # keep JAX's SIGTERM notifier; route SIGINT to it
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._to_sigterm)
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _to_sigterm(self, signum, frame):
        self.received = signum
        os.kill(os.getpid(), signal.SIGTERM)

    def _handle(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user means it
        self.received = signum

    @property
    def requested(self):
        return self.received is not None

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class StepGuard:
    """Watches each step's `skipped` flag and loss, one step behind the device.

    Counts skipped steps; once `max_consecutive_skips` were skipped in a row, `error` says
    so (the loop stops, saving nothing more, and raises NonFiniteError once the saves in
    flight complete). With `spike_factor` > 0, a loss above spike_factor x the mean of the
    last `spike_window` losses sets `spike` = (step, loss, mean): the loop rolls back."""

    @classmethod
    def of(cls, train_cfg, total):
        """The guard of a run's train.* settings, `total` steps skipped so far."""
        return cls(
            train_cfg.max_consecutive_skips, train_cfg.spike_factor, train_cfg.spike_window, total
        )

    def __init__(self, max_consecutive_skips, spike_factor=0.0, spike_window=20, total=0):
        self.limit = max_consecutive_skips
        self.spike_factor = spike_factor
        self.total = total
        self.consecutive = 0
        self.error = None
        self.spike = None
        self._recent = collections.deque(maxlen=spike_window)
        self._pending = None  # (step, device metrics) not yet read

    def push(self, step, metrics):
        """Record step `step`'s device metrics; reads the previous step's."""
        self.flush()
        self._pending = (step, (metrics['skipped'], metrics['loss']))

    def settle(self, position):
        """`position` with the skipped-step count read up to its step (before a save or a
        log record)."""
        self.flush()
        return position.counted(self.total)

    def flush(self):
        """Read the pending step now (before a save, a log record or the end of the run)."""
        if self._pending is None:
            return
        step, flags = self._pending
        self._pending = None
        skipped, loss = jax.device_get(flags)
        if skipped:
            self._skipped(step)
            return
        self.consecutive = 0
        recent = self._recent
        if self.spike_factor and len(recent) == recent.maxlen and self.spike is None:
            mean = sum(recent) / len(recent)
            if loss > self.spike_factor * mean:
                self.spike = (step, float(loss), mean)
                return
        recent.append(float(loss))

    def _skipped(self, step):
        self.total += 1
        self.consecutive += 1
        print(f'warning: step {step} skipped: non-finite loss or gradient norm', flush=True)
        if self.consecutive >= self.limit and self.error is None:
            self.error = (
                f'{self.consecutive} consecutive steps up to step {step} had a non-finite loss '
                f'or gradient norm (train.max_consecutive_skips={self.limit}); the run stops '
                f'with its checkpoints as they were'
            )


def drills_of(train_cfg):
    """{step: drill} of the train-step drills a config asks for (tests and rehearsals)."""
    drills = {train_cfg.inject_spike_at_step: 'spike'}
    first_nan = train_cfg.inject_nan_at_step
    drills.update(dict.fromkeys(range(first_nan, first_nan + train_cfg.inject_nan_steps), 'nan'))
    return drills


def _drilled_here(at, process, first_step, step):
    """A process drill fires only in a run started from scratch, so that the same command,
    run again, resumes past it."""
    return bool(at) and step == at and first_step == 0 and jax.process_index() == process


def kill_if_drilled(config, first_step, done, checkpoints):
    """The process-loss drill: process train.inject_kill_process SIGKILLs itself once step
    train.inject_kill_at_step is done (a lost node), its saves in flight complete first (the
    drill loses a process, not the checkpoint)."""
    train_cfg = config.train
    if _drilled_here(
        train_cfg.inject_kill_at_step, train_cfg.inject_kill_process, first_step, done
    ):
        checkpoints.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def raise_if_failed(non_finite, save_failed):
    """After the loop: NonFiniteError or SaveFailedError with their messages, if any."""
    if non_finite:
        raise NonFiniteError(non_finite)
    if save_failed:
        raise SaveFailedError(save_failed)


def hang_if_drilled(config, first_step, step):
    """The hang drill: process train.inject_hang_process stops making progress while it
    reads the batch of step train.inject_hang_at_step (a deadlocked data worker, a dead file
    system), alive and sending heartbeats, until its watchdog ends it."""
    train_cfg = config.train
    if _drilled_here(
        train_cfg.inject_hang_at_step, train_cfg.inject_hang_process, first_step, step
    ):
        print(
            f'drill        process {jax.process_index()} hangs at step {step} '
            f'(train.inject_hang_at_step)',
            flush=True,
        )
        while True:
            time.sleep(3600)
