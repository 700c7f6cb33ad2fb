"""Progress watchdog: a training process that stops making progress but stays alive (stuck in
a collective whose peer is gone, a dead file system, a deadlocked data worker) ends itself
instead of holding the job's devices forever. The heartbeat of jax.distributed cannot see
it: its heartbeat thread keeps running.

The loop tells the watchdog which phase it is in; a thread checks that the phase ends within
its allowance:

    batch        next(batches): host work only (the data reader, the file system)
    step         dispatching a step and reading its results back    } wait on the devices,
    evaluation   the validation batches                             } whose collectives wait
    save         copying the state off the devices, storage waits   } on every other process

    allowance    train.hang_timeout_s when set (> 0), else
                 max(train.hang_floor_s, 10 x the slowest phase of that kind so far)

Restores and compiles are not watched (`unwatched`): the first compile of a large model and
its restore take minutes, and neither says anything about a stall. Nor is a peer's compile:
the loop's compiles end with every process waiting for the others (train/loop.py,
CompiledSteps).

A phase that waits on the devices may be waiting for a stalled peer: it gets
distributed.heartbeat_timeout_s more than its allowance. The stalled process, whose own
watchdog fires first, exits; the coordination service (or a collective that fails) then ends
the waiting ones within that time, and the one log that says `stalled` is the culprit's.

When a phase overruns, the watchdog writes every thread's Python stack to stderr
(faulthandler), then one line naming the process, the phase and where its main thread is,
and exits with status 3 (STALLED) without any clean-up that could itself block. The peers,
spawn.py and SLURM's --kill-on-bad-exit then end the job.

A stall that holds the GIL (a C call that blocks without releasing it) would stop this
thread too: faulthandler's own timer, armed at every phase change and re-armed by the thread
at every check, is the backstop. It fires only when neither could run for the phase's
allowance and BACKSTOP_MARGIN_S more, prints `Timeout (h:mm:ss)!` and the stacks, and exits
with status 1.
"""

import contextlib
import faulthandler
import os
import sys
import threading
import time

STALLED = 3  # exit status of a process whose watchdog fired
SLOWEST_FACTOR = 10  # a derived allowance: this many times the slowest phase of its kind
BACKSTOP_MARGIN_S = 30
POLL_S = 1.0
DEVICE_PHASES = ('step', 'evaluation', 'save')


class Watchdog:
    """Watches phases of the training loop (see the module docstring).

        with watchdog.phase('step', 'step 12'):      # timed; allowance as above
            ...
            with watchdog.unwatched():               # a compile inside the phase
                ...                                  # the phase's clock restarts after it

    timeout_s: fixed allowance (0: derived, at least floor_s); peer_grace_s: the extra time of
    a phase that waits on the devices (the heartbeat timeout in a run of several processes,
    else 0); estimates: {kind: function returning an expected duration} for kinds not yet
    seen (e.g. the first evaluation from the step time); name: 'process K of N';
    stderr_fd: where the stacks and the line go."""

    def __init__(
        self,
        timeout_s,
        floor_s,
        peer_grace_s=0.0,
        estimates=None,
        name='process 0 of 1',
        stderr_fd=2,
        exit=os._exit,
    ):
        self.timeout_s, self.floor_s, self.peer_grace_s = timeout_s, floor_s, peer_grace_s
        self.estimates = estimates or {}
        self.name, self.stderr_fd, self._exit = name, stderr_fd, exit
        self.slowest = {}  # kind -> longest completed phase of that kind, seconds
        self._current = None  # (kind, label, started); replaced whole, so read without a lock
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name='watchdog', daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._current = None
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        faulthandler.cancel_dump_traceback_later()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def allowance(self, kind):
        """Seconds a phase of `kind` may take before this process calls itself stalled."""
        if self.timeout_s:
            base = self.timeout_s
        else:
            seen = self.slowest.get(kind) or self.estimates.get(kind, lambda: 0.0)()
            base = max(self.floor_s, SLOWEST_FACTOR * seen)
        return base + (self.peer_grace_s if kind in DEVICE_PHASES else 0.0)

    def how(self, kind):
        """Where an allowance comes from, for the stall line."""
        if self.timeout_s:
            return 'train.hang_timeout_s'
        return f'max(train.hang_floor_s, {SLOWEST_FACTOR} x the slowest {kind} so far)'

    @contextlib.contextmanager
    def phase(self, kind, label):
        """Time a phase; `label` says what it is doing (e.g. 'step 12')."""
        outer = self._current
        self._current = (kind, label, time.monotonic())
        self._rearm()  # here, not only in the thread: it may not run again
        try:
            yield
        finally:
            kind, _, started = self._current
            elapsed = time.monotonic() - started
            self.slowest[kind] = max(self.slowest.get(kind, 0.0), elapsed)
            self._current = outer
            self._rearm()

    @contextlib.contextmanager
    def unwatched(self):
        """Not watched (a compile, a restore); the phase around it starts its clock again."""
        outer, self._current = self._current, None
        self._rearm()  # cancels it
        try:
            yield
        finally:
            if outer is not None:
                outer = (outer[0], outer[1], time.monotonic())
            self._current = outer
            self._rearm()

    def _watch(self):
        while not self._stop.is_set():
            current = self._current
            wait = POLL_S
            if current is not None:
                kind, label, started = current
                allowance = self.allowance(kind)
                elapsed = time.monotonic() - started
                if elapsed > allowance:
                    self._fire(kind, label, elapsed, allowance)
                    return
                wait = min(POLL_S, allowance - elapsed + 0.05)
                self._arm_backstop(allowance - elapsed)
            else:
                faulthandler.cancel_dump_traceback_later()
            self._stop.wait(wait)

    def _rearm(self):
        """The backstop for the phase now current (cancelled between phases)."""
        current = self._current
        if current is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            self._arm_backstop(self.allowance(current[0]) - (time.monotonic() - current[2]))

    def _arm_backstop(self, seconds_left):
        """faulthandler's timer: fires only if nothing re-arms or cancels it for the phase's
        remaining allowance and BACKSTOP_MARGIN_S more, i.e. if this thread cannot run."""
        faulthandler.dump_traceback_later(
            seconds_left + BACKSTOP_MARGIN_S, exit=True, file=self.stderr_fd
        )

    def _fire(self, kind, label, elapsed, allowance):
        faulthandler.cancel_dump_traceback_later()
        os.write(self.stderr_fd, f'{self.name}: stacks of every thread\n'.encode())
        faulthandler.dump_traceback(file=self.stderr_fd, all_threads=True)
        line = (
            f'error: {self.name} stalled: {kind} ({label}) made no progress for {elapsed:.0f} s '
            f'(allowance {round(allowance, 1):g} s: {self.how(kind)}), its main thread at '
            f'{where(sys._current_frames().get(self._main))}; exiting with status {STALLED}\n'
        )
        os.write(self.stderr_fd, line.encode())
        self._exit(STALLED)


def where(frame):
    """'file:line in function' of a frame, and of the innermost mtnlg_jax frame under it when
    that is another one (a stall in JAX or orbax, called from the loop)."""
    if frame is None:
        return 'an unknown place'

    def describe(f):
        code = f.f_code
        return f'{_short(code.co_filename)}:{f.f_lineno} in {code.co_name}'

    text, ours = describe(frame), frame
    while ours is not None and f'{os.sep}mtnlg_jax{os.sep}' not in ours.f_code.co_filename:
        ours = ours.f_back
    if ours is not None and ours is not frame:
        text += f' (called from {describe(ours)})'
    return text


def _short(path):
    """A path from its package root on (mtnlg_jax/..., jax/..., orbax/...)."""
    parts = path.split(os.sep)
    for root in ('mtnlg_jax', 'site-packages', 'launch'):
        if root in parts:
            i = parts.index(root)
            return os.sep.join(parts[i + (root == 'site-packages') :])
    return path
