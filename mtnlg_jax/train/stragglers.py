"""The slow process named: each process measures what it alone controls, and every
train.straggler_every steps the processes compare.

    host     the share of the interval this process's host could not run when it asked to:
             a thread that wakes every 10 ms adds up how late it woke (a throttled or
             oversubscribed host, a process stopped from outside); reported as the slowdown
             1 / (1 - share)
    batch    seconds per step this process spent reading its rows of the batches
    device   seconds of a fixed probe (a small matmul, no collective) on each of this
             process's own devices, the best of 5 rounds

No measurement waits for another process. At the comparison one all-gather of these few floats
(jax's multihost_utils) reaches every process; process 0 names a process whose measure is
above train.straggler_ratio x the median of the others' (with 2 processes: the other's) in one
line, and every process's relative speed (the median of the others over its own, on its worst
measure; 1.0 is as fast as the rest) goes into the next metrics record. docs/faults.md says
what the line means and what to do.
"""

import socket
import statistics
import threading
import time

import jax
import numpy as np

TICK_S = 0.01
PROBE_SIZE = 256
PROBE_ROUNDS = 5
KINDS = ('host', 'batch', 'device')
# Below these a measure is noise, never named: the batch a process reads in under 5 ms a step,
# a probe under 1 ms, a host stalled under 5 % of the time.
FLOORS = dict(host=1 / (1 - 0.05), batch=0.005, device=0.001)


class _Lag(threading.Thread):
    """Adds up how late each 10 ms wake-up of this thread comes."""

    def __init__(self):
        super().__init__(name='mtnlg_jax straggler lag', daemon=True)
        self.late_s, self._stop = 0.0, threading.Event()

    def run(self):
        while not self._stop.is_set():
            start = time.monotonic()
            self._stop.wait(TICK_S)
            self.late_s += max(0.0, time.monotonic() - start - TICK_S)

    def stop(self):
        self._stop.set()


def _probe_on(device):
    """The probe of one device: run under a mesh of that device alone (the run's mesh spans
    every process)."""
    mesh = jax.sharding.Mesh(np.array([device]), ('probe',))
    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((PROBE_SIZE, PROBE_SIZE), np.float32), device)
    fn = jax.jit(lambda a: (a @ a).sum())

    def run():
        with jax.set_mesh(mesh):
            return jax.block_until_ready(fn(x))

    return run


class Stragglers:
    """Measures this process, compares every `every` steps (0: never; nothing with one
    process)."""

    def __init__(self, config, say):
        train_cfg = config.train
        self.every, self.ratio = train_cfg.straggler_every, train_cfg.straggler_ratio
        self.on = bool(self.every) and jax.process_count() > 1
        self.say = say
        self.speeds = None  # every process's relative speed at the last comparison
        self.cost_s = None  # seconds the last comparison took here (probe and all-gather)
        self.named = []  # (step, process, kind, factor) of every straggler named
        if not self.on:
            return
        self._probes = [_probe_on(d) for d in jax.local_devices()]
        for probe in self._probes:  # compiled now, outside any measured interval
            probe()
        self._lag = _Lag()
        self._lag.start()
        self._reset(0)

    def _reset(self, step):
        self._since, self._wall, self._late = step, time.monotonic(), self._lag.late_s
        self._batch_s = 0.0

    def batch_read(self, seconds):
        if self.on:
            self._batch_s += seconds

    def _device_s(self):
        """The slowest device's best of PROBE_ROUNDS probes, the devices taken in turn each
        round: a burst of other work on the host lands on one round, not on every probe of
        one device."""
        best = [float('inf')] * len(self._probes)
        for _ in range(PROBE_ROUNDS):
            for i, probe in enumerate(self._probes):
                start = time.perf_counter()
                probe()
                best[i] = min(best[i], time.perf_counter() - start)
        return max(best)

    def _measures(self, step):
        wall = time.monotonic() - self._wall
        share = min(0.95, (self._lag.late_s - self._late) / max(wall, 1e-9))
        steps = max(1, step - self._since)
        return np.array([1 / (1 - share), self._batch_s / steps, self._device_s()], np.float64)

    def maybe_compare(self, step, state):
        """At every `every`-th step, on every process: the comparison (one all-gather). The
        step still in flight (`state`, dispatched asynchronously) is waited for first: a probe
        queued behind it would time the step, not the device."""
        if not (self.on and step % self.every == 0):
            return
        from jax.experimental import multihost_utils

        jax.block_until_ready(state)
        start = time.perf_counter()
        mine = self._measures(step)
        hosts = np.frombuffer(socket.gethostname().encode()[:32].ljust(32), np.uint8)
        gathered = multihost_utils.process_allgather(
            np.concatenate([mine, hosts.astype(np.float64)])
        )
        measures, names = gathered[:, : len(KINDS)], gathered[:, len(KINDS) :]
        self.speeds = relative_speeds(measures)
        self.cost_s = round(time.perf_counter() - start, 5)
        for process, kind, factor, median in slow(measures, self.ratio):
            self.named.append((step, process, kind, factor))
            host = bytes(names[process].astype(np.uint8)).decode(errors='replace').strip()
            self.say(line(step, self._since, process, host, kind, factor, measures, median))
        self._reset(step)

    def close(self):
        if self.on:
            self._lag.stop()


def others_median(column, process):
    return statistics.median(np.delete(column, process))


def slow(measures, ratio):
    """(process, kind, factor, the others' median) of each process above `ratio` x the
    median of the others on a measure (its worst one), worst first."""
    found = []
    for process in range(len(measures)):
        worst = None
        for k, kind in enumerate(KINDS):
            value, median = measures[process, k], others_median(measures[:, k], process)
            if value <= FLOORS[kind]:
                continue
            factor = value / max(median, FLOORS[kind])
            if factor > ratio and (worst is None or factor > worst[2]):
                worst = (process, kind, factor, median)
        if worst:
            found.append(worst)
    return sorted(found, key=lambda f: -f[2])


def relative_speeds(measures):
    """Per process: the median of the others over its own, on its worst measure (1.0: as
    fast as the rest; 0.5: half as fast)."""
    speeds = []
    for process in range(len(measures)):
        ratios = [
            max(others_median(measures[:, k], process), FLOORS[kind])
            / max(measures[process, k], FLOORS[kind])
            for k, kind in enumerate(KINDS)
        ]
        speeds.append(round(float(min(ratios)), 3))
    return speeds


def line(step, since, process, host, kind, factor, measures, median):
    value = measures[process, KINDS.index(kind)]
    what = {
        'host': f'its host ran {1 / value:.0%} of the time it asked for (the others '
        f'{1 / median:.0%})',
        'batch': f'reading its batches took {value * 1e3:.1f} ms a step (the others '
        f'{median * 1e3:.1f} ms)',
        'device': f'its devices took {value * 1e3:.2f} ms on the probe (the others '
        f'{median * 1e3:.2f} ms)',
    }[kind]
    return (
        f'straggler    process {process} on {host}: {kind} {factor:.1f}x slower than the '
        f'median of the others at steps {since + 1}-{step}: {what}'
    )
