"""A Ray job that stops moving ends with one line instead of waiting forever.

A curation whose workers cannot start (Ray throttles worker start-up on an overloaded machine),
or whose task hangs on a dead file system, would otherwise wait without end: Ray retries
tasks whose process died, but it has no bound on a task that never finishes. The driver
watches a heartbeat file in the work folder instead:

    (curate.py's stages; preprocess.py's tokenization, whose partial work a rerun redoes)
    workers   touch WORK/.heartbeat after each batch of every transform (`beating(fn, folder)`)
    driver    touches it when a stage starts (`watch.stage(name)`); a thread checks its age
              (before the work folder exists, while the inputs are scanned, the driver's
              own clock of the last stage start)
    stalled   no touch for `timeout_s`: Ray shut down (bounded, its output silenced), one line
              `error: ... no progress for N s in stage S ...` on stderr, exit status 3
              (STALLED, as training's watchdog)

The work folder keeps every finished stage, so a rerun resumes where the stall was. A Ray
Data shuffle runs Ray's own tasks, which do not touch the heartbeat: the bound must be longer
than the longest shuffle of the corpus (the default 900 s; `--stall_timeout_s 0` turns it off).
The folder is shared by every node of a cluster (the work folder already is), and a file's
modification time is what each node's touch sets.
"""

import functools
import os
import sys
import threading
import time

HEARTBEAT = '.heartbeat'
STALLED = 3  # exit status, as train/watchdog.py's
SHUTDOWN_S = 20  # how long the stalled driver waits for ray.shutdown before it exits


def beat(folder):
    """Progress: the heartbeat file's modification time set to now."""
    path = os.path.join(folder, HEARTBEAT)
    with open(path, 'a'):
        os.utime(path)


def beating(fn, folder):
    """fn(batch, **kwargs) for Ray Data's map_batches / map_groups, beating after each batch."""
    return functools.partial(_beating, fn, folder)


def _beating(fn, heartbeat_folder, batch, /, **kwargs):
    out = fn(batch, **kwargs)  # positional-only above: a transform's own `folder` passes through
    beat(heartbeat_folder)
    return out


def _stalled(message):
    """Give Ray a bounded chance to shut down, print the line, exit STALLED. What Ray and the
    interrupted main thread write meanwhile goes to /dev/null: the error is the one line."""
    import ray  # noqa: PLC0415

    sys.stderr.flush()
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:
        closing = threading.Thread(target=ray.shutdown, daemon=True)
        closing.start()
        closing.join(SHUTDOWN_S)
    finally:
        os.dup2(saved, 2)
        os.write(2, f'error: {message}\n'.encode())
        os._exit(STALLED)


class StallWatch:
    """Watches WORK/.heartbeat while the block runs (see the module docstring):

    with StallWatch(folder, timeout_s, 'curate') as watch:
        watch.stage('signatures')
        ...
    """

    def __init__(self, folder, timeout_s, tool, on_stall=_stalled, poll_s=1.0, resumes=True):
        self.folder, self.timeout_s, self.tool, self.resumes = folder, timeout_s, tool, resumes
        self.on_stall, self.poll_s = on_stall, poll_s
        self.current, self.last = 'scan', time.time()
        self._stop = threading.Event()
        self._thread = None

    def stage(self, name):
        """A stage starts: progress (in the heartbeat too once the work folder exists; before,
        nothing is written, so that bad input leaves no folder behind)."""
        self.current, self.last = name, time.time()
        if os.path.isdir(self.folder):
            beat(self.folder)

    def age_s(self):
        try:
            touched = os.path.getmtime(os.path.join(self.folder, HEARTBEAT))
        except OSError:
            touched = 0.0
        return time.time() - max(touched, self.last)

    def _run(self):
        kept = (
            f'finished stages are kept in {self.folder}, and a rerun resumes there'
            if self.resumes
            else f'a rerun starts over (the partial work in {self.folder} is removed)'
        )
        while not self._stop.wait(self.poll_s):
            age = self.age_s()
            if age > self.timeout_s:
                self.on_stall(
                    f'{self.tool}: no progress for {age:.0f} s in stage {self.current} '
                    f'(--stall_timeout_s {self.timeout_s:g}: a Ray worker that did not start or '
                    f'a task that did not end); {kept}'
                )
                return

    def __enter__(self):
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name='stall-watch', daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
