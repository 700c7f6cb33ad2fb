"""Profile-guided latency estimation (PGLE) for the ahead-of-time compiled train step
(train.pgle_profile_steps).

XLA:GPU's latency-hiding scheduler orders the step by its own estimate of what each
instruction costs; where that estimate is off, a collective starts too late to hide (Llama 3
405B at 128K: docs/benchmarks.md, "Long context"). JAX's PGLE (`JAX_ENABLE_PGLE`) fixes
that for functions it calls through `jax.jit`, not for a step compiled ahead of time as ours
is (train/loop.py's CompiledSteps), where it does nothing. So the loop does it itself, once
for each micro-step count the run reaches (its first, then each new size of the batch
ramp-up: a profile names the instructions of the one program it traced):

    step c                      the first step at count M (compiled before, run untraced)
    steps c + 1 .. c + N        traced on process 0 (jax.profiler, into WORKDIR/pgle/trace-mM;
                                N = train.pgle_profile_steps)
    then                        the trace's measured costs (ProfiledInstructionsProto) written
                                to WORKDIR/pgle/profile-mM.pb; every process compiles the step
                                of M again with XLA reading it (one file, one schedule everywhere)

The windows follow from the ramp-up (`windows`), so that train.profile_start's range can move
past them (train/profile.py); a size whose stage is too short to hold its window, and a drill's
variant and the evaluation step, keep XLA's own schedule. A window whose steps ran another
count (a loss spike's roll-back moved the ramp-up) compiles nothing. A resumed run profiles
again from its first count on (its program may differ): it overwrites the files of the counts
it profiles and reads no file it did not write, so an older run's file is never read.

The results do not change: the same program, scheduled in another order. On XLA:CPU the trace
holds no costs and the step keeps its schedule (a line says so). `launch/plan.py --target`
compiles such a config twice, with the replay's costs as the profile (plan/pgle.py).
"""

import contextlib
import glob
import os

import jax

from mtnlg_jax import config as config_lib
from mtnlg_jax.config import rampup
from mtnlg_jax.run import distributed
from mtnlg_jax.run.rundir import RunDir
from mtnlg_jax.train.profile import steps_text, tracing
from mtnlg_jax.xla import flags


def profiled_costs(trace_directory):
    """The serialized ProfiledInstructionsProto of the newest trace under `trace_directory`
    (empty off NVIDIA GPUs)."""
    from jax.experimental import profiler  # noqa: PLC0415

    runs = sorted(glob.glob(os.path.join(trace_directory, 'plugins', 'profile', '*')))
    return profiler.get_profiled_instructions_proto(runs[-1]) if runs else b''


def count_starts(config, first_step, samples_consumed):
    """[(the first step at a micro-step count, that count)] of the steps after `first_step`
    up to train.steps, `samples_consumed` samples in: a stage's end found by bisection (the
    batch only grows with the samples consumed)."""
    train_cfg, seq_len = config.train, config.model.seq_len
    per_row = train_cfg.micro_batch * config_lib.replicas(config.mesh)
    starts, step = [], first_step + 1
    while step <= train_cfg.steps:
        batch = rampup.global_batch_at(train_cfg, seq_len, samples_consumed)
        starts.append((step, batch // per_row))
        low, high = 0, train_cfg.steps - step  # the stage's last step is step + [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            same = rampup.global_batch_at(train_cfg, seq_len, samples_consumed + middle * batch)
            low, high = (middle, high) if same == batch else (low, middle - 1)
        step, samples_consumed = step + low + 1, samples_consumed + (low + 1) * batch
    return starts


def windows(starts, steps):
    """[(first, last, count)]: the `steps` steps after each count's first, where its stage
    holds them."""
    ends = [start for start, _ in starts[1:]] + [float('inf')]
    return [
        (start + 1, start + steps, count)
        for (start, count), end in zip(starts, ends)
        if steps and start + steps < end
    ]


class ProfileGuided:
    """Traces a window of steps at each micro-step count and compiles that count's step again
    by their costs."""

    def __init__(self, config, workdir, starts, say):
        """starts: count_starts(...) of this run."""
        self.windows = windows(starts, config.train.pgle_profile_steps)
        self.directory = os.path.join(RunDir(workdir).path, 'pgle')
        self.say = say
        self._open = None  # the window being traced
        self._trace = None

    def step(self, step):
        """The context of one step: process 0 traces the windows' steps."""
        opening = [window for window in self.windows if window[0] == step]
        if opening and self._open is None:
            self._open = opening[0]
            if jax.process_index() == 0:
                self._trace = tracing(self._traces())
                self._trace.__enter__()
        return contextlib.nullcontext()

    def stepped(self, step, state, compiled, micro_steps):
        """After a step of `micro_steps` micro-steps: at its window's last, the costs written
        and that count's step compiled again by them (compiled.recompile), on every process."""
        if self._open is None:
            return
        first, last, count = self._open
        if micro_steps != count or step == last:
            self.windows.remove(self._open)
            jax.block_until_ready(state)
            self.close()
        if micro_steps != count:
            self.say(f'pgle         {steps_text(first, step)} traced: step {step} ran '
                     f'{micro_steps} micro-steps, not {count}: nothing compiled again')  # fmt: skip
        elif step == last:
            self._compile(first, last, count, compiled)

    def _compile(self, first, last, count, compiled):
        profile = os.path.join(self.directory, f'profile-m{count}.pb')
        if jax.process_index() == 0:
            with open(profile, 'wb') as f:
                f.write(profiled_costs(self._traces(count)))
        distributed.wait_for_peers('pgle profile written')
        if not os.path.getsize(profile):
            self.say(
                f'pgle         {steps_text(first, last)} traced: no instruction costs '
                f'(XLA:GPU on NVIDIA GPUs gives them): the step keeps its schedule'
            )
            return
        compiled.recompile(count, {flags.PGLE_PROFILE_OPTION: profile})
        self.say(
            f'pgle         the step compiled again, scheduled by the costs of '
            f'{steps_text(first, last)}: {profile}'
        )

    def _traces(self, count=None):
        count = self._open[2] if count is None else count
        return os.path.join(self.directory, f'trace-m{count}')

    def close(self):
        """The trace stopped (a run that ended inside a window: nothing compiled)."""
        self._open = None
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
