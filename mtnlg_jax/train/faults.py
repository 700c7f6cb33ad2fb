"""Faults a long run must survive: preemption signals and non-finite steps.

Preemption: SIGTERM (what schedulers send before they kill) or SIGINT (Ctrl-C) sets a flag;
the loop finishes the step it is on, saves, and exits 0. A second SIGINT interrupts at once.
Multi-process runs ask orbax instead (`Checkpoints.reached_preemption`), so that every
process stops at the same step.

Non-finite steps: the train step itself keeps the old parameters and optimizer state when
the loss or the gradient norm is NaN or Inf (jnp.where inside the jitted step) and reports
`skipped`. The host reads that flag one step late, while the next step already runs, so
counting never stalls the device:

    dispatch step n  ->  read skipped of step n-1  ->  dispatch step n+1  -> ...
"""

import signal

import jax


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops, its checkpoints untouched."""


class StopSignals:
    """Context manager: while inside, SIGTERM and SIGINT request a stop instead of killing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

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


class SkipCounter:
    """Counts skipped steps from each step's `skipped` flag, one step behind the device.
    Once `limit` consecutive steps were skipped, `error` says so (the loop stops, saving
    nothing more, and raises NonFiniteError after the saves in flight complete)."""

    def __init__(self, limit, total=0):
        self.limit = limit
        self.total = total
        self.consecutive = 0
        self.error = None
        self._pending = None  # (step, device flag) not yet read

    def push(self, step, skipped):
        """Record step `step`'s device flag; reads the previous step's."""
        self.flush()
        self._pending = (step, skipped)

    def flush(self):
        """Read the pending flag now (before a save, a log record or the end of the run)."""
        if self._pending is None:
            return
        step, skipped = self._pending
        self._pending = None
        if not bool(jax.device_get(skipped)):
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        print(f'warning: step {step} skipped: non-finite loss or gradient norm', flush=True)
        if self.consecutive >= self.limit and self.error is None:
            self.error = (
                f'{self.consecutive} consecutive steps up to step {step} had a non-finite loss '
                f'or gradient norm (train.max_consecutive_skips={self.limit}); the run stops '
                f'with its checkpoints as they were'
            )
