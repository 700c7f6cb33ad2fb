"""A jax.profiler trace of a range of train steps, on request (train.profile_start and
train.profile_steps; process 0, or every process with train.profile_all_processes).

    WORKDIR/profile/process_N/plugins/profile/<time>/<host>.xplane.pb   TensorBoard's profile
    WORKDIR/profile/process_N/plugins/profile/<time>/perfetto_trace.json.gz   Perfetto

Each traced step is a StepTraceAnnotation (`train`, step_num) holding the phases the loop
annotates, `batch`, `step` and `save`; the line `profile      steps A-B traced: PATH` says
where the trace went. bench/gpu_check.py's profile section traces through `tracing` too.
"""

import contextlib
import glob
import os

import jax

from mtnlg_jax.run.rundir import RunDir


def trace_files(directory):
    """The trace files under `directory`, newest last."""
    found = glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True)
    found += glob.glob(os.path.join(directory, '**', '*.trace.json.gz'), recursive=True)
    found += glob.glob(os.path.join(directory, '**', 'perfetto_trace.json.gz'), recursive=True)
    return sorted(found, key=os.path.getmtime)


@contextlib.contextmanager
def tracing(directory):
    """A jax.profiler trace (TensorBoard's xplane.pb and Perfetto's json.gz) into
    `directory` while inside."""
    os.makedirs(directory, exist_ok=True)
    jax.profiler.start_trace(str(directory), create_perfetto_trace=True)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def steps_text(first, last):
    return f'step {first}' if first == last else f'steps {first}-{last}'


def directory_of(workdir, process=None):
    process = jax.process_index() if process is None else process
    return os.path.join(RunDir(workdir).path, 'profile', f'process_{process}')


class StepProfile:
    """Traces steps [train.profile_start, + train.profile_steps) of this process, if asked."""

    def __init__(self, config, workdir, say, after=()):
        """after: [(first, last, ...)] steps other traces take (train/pgle.py's windows); a
        range that meets one moves to the step after it, where the step runs its new
        schedule, and on past any other it then meets."""
        train_cfg = config.train
        self.first = train_cfg.profile_start
        self.last = self.first + train_cfg.profile_steps - 1
        here = jax.process_index() == 0 or train_cfg.profile_all_processes
        self.wanted = bool(self.first) and here
        met = []
        for first, last, *_ in sorted(after) if self.wanted else ():
            if self.first <= last and self.last >= first:
                self.first, self.last = last + 1, last + train_cfg.profile_steps
                met.append(steps_text(first, last))
        if met:
            say(f'profile      moved to steps {self.first}-{self.last}: pgle traces '
                f'{", ".join(met)}')  # fmt: skip
        self.directory = directory_of(workdir)
        self.say = say
        self._trace = None  # the tracing context while a trace runs

    def step(self, step):
        """The context of one step: the trace starts before the first profiled step; the step
        is annotated while tracing."""
        if self.wanted and self._trace is None and self.first <= step <= self.last:
            self._trace = tracing(self.directory)
            self._trace.__enter__()
            self._started = step
        if self._trace is None:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation('train', step_num=step)

    def phase(self, name):
        """An annotation of a phase of the step (batch, step, save) while tracing."""
        if self._trace is None:
            return contextlib.nullcontext()
        return jax.profiler.TraceAnnotation(name)

    def stepped(self, step, state):
        """After step `step` (its save included): the trace ends after the last profiled one,
        once the devices finished it."""
        if self._trace is not None and step >= self.last:
            self.close(state)

    def close(self, state=None):
        if self._trace is None:
            return
        if state is not None:
            jax.block_until_ready(state)
        self._trace.__exit__(None, None, None)
        self._trace, self.wanted = None, False
        files = trace_files(self.directory)
        where = files[-1] if files else self.directory
        self.say(f'profile      steps {self._started}-{self.last} traced: {where}')
