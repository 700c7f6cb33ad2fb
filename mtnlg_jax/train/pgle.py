"""Profile-guided latency estimation (PGLE) for the ahead-of-time compiled train step
(train.pgle_profile_steps).

XLA:GPU's latency-hiding scheduler orders the step by its own estimate of what each
instruction costs; where that estimate is off, a collective starts too late to hide (Llama 3
405B at 128K: docs/benchmarks.md, "Long context"). JAX's PGLE (`JAX_ENABLE_PGLE`) fixes
that for functions it calls through `jax.jit`, not for a step compiled ahead of time as ours
is (train/loop.py's CompiledSteps), where it does nothing. So the loop does it itself:

    step s0 + 1                 the first step of this run (compiled before, run untraced)
    steps s0 + 2 .. s0 + 1 + N  traced on process 0 (jax.profiler; N = train.pgle_profile_steps)
    then                        the trace's measured costs (ProfiledInstructionsProto) written
                                to WORKDIR/pgle/profile.pb; every process compiles the step
                                again with XLA reading it (one file, one schedule everywhere)

The results do not change: the same program, scheduled in another order. On XLA:CPU the trace
holds no costs and the step keeps its schedule (a line says so). `launch/plan.py --target`
compiles such a config twice, with the replay's costs as the profile (plan/pgle.py).
"""

import contextlib
import glob
import os

import jax

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


class ProfileGuided:
    """Traces the steps after the run's first and compiles the step again by their costs."""

    def __init__(self, config, workdir, first_step, say):
        self.steps = config.train.pgle_profile_steps
        self.first, self.last = first_step + 2, first_step + 1 + self.steps
        self.directory = os.path.join(RunDir(workdir).path, 'pgle')
        self.traces = os.path.join(self.directory, 'trace')
        self.say = say
        self._trace = None

    @property
    def window(self):
        """(first, last) steps traced, or None when off."""
        return (self.first, self.last) if self.steps else None

    def step(self, step):
        """The context of one step: process 0 traces the window's steps."""
        if self.steps and self._trace is None and step == self.first:
            if jax.process_index() == 0:
                self._trace = tracing(self.traces)
                self._trace.__enter__()
        return contextlib.nullcontext()

    def stepped(self, step, state, compiled, micro_steps):
        """After the window's last step (of `micro_steps` micro-steps): the costs written,
        that step compiled again by them (compiled.recompile), on every process."""
        if not self.steps or step != self.last:
            return
        jax.block_until_ready(state)
        profile = os.path.join(self.directory, 'profile.pb')
        if self._trace is not None:
            self.close()
            with open(profile, 'wb') as f:
                f.write(profiled_costs(self.traces))
        distributed.wait_for_peers('pgle profile written')
        if not os.path.getsize(profile):
            self.say(
                f'pgle         {steps_text(self.first, self.last)} traced: no instruction costs '
                f'(XLA:GPU on NVIDIA GPUs gives them): the step keeps its schedule'
            )
            return
        compiled.recompile(micro_steps, {flags.PGLE_PROFILE_OPTION: profile})
        self.say(
            f'pgle         the step compiled again, scheduled by the costs of '
            f'{steps_text(self.first, self.last)}: {profile}'
        )

    def close(self):
        """The trace stopped (a run that ended inside the window: nothing compiled)."""
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
