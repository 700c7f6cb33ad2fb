"""The training loop: a short loop around one run position (step, state, counters).

    position = restore or initialise          (resume.py; any layout, any process count)
    compile the first step (ahead of time, timed), print the banner
    while position.step < train.steps:
        batch   = next global batch             (ramp-up: its size grows; a new size compiles)
        position = position after train_step    (CompiledSteps caches one per micro-step count)
        log      every train.log_every          (reporter.py: step_record, a pure function)
        profile  train.profile_steps from train.profile_start   (profile.py: a jax.profiler trace)
        pgle     steps of each micro-step count traced, its step compiled again by them (pgle.py)
        compare  the processes' own speeds every train.straggler_every  (stragglers.py)
        save     every checkpoint.every, at the end, on SIGTERM   (periodic.py: Saver)
        evaluate every train.eval_every, at the end               (periodic.py: Evaluator)
        loss spike?  position = roll_back       (resume.py; the data moves on past the spike)
    evaluate, write the loss-curve PNG

Each part of a step (batch, step, save, evaluation) runs in a phase of the progress watchdog
(train/watchdog.py), which ends a process that stalls; compiles and restores run unwatched.

Several processes run this same loop on their own devices; each reads only its rows of each
batch and writes its shards of each checkpoint. Process 0 alone prints (banner, progress bar,
messages) and writes config.json, metrics.jsonl, tensorboard events and the PNG.
"""

import os
import time

import jax
import jax.numpy as jnp

from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.run import distributed
from mtnlg_jax.model import counts
from mtnlg_jax.xla import devices
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.data import packing
from mtnlg_jax import config as config_lib
from mtnlg_jax.config import rampup
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.run import storage
from mtnlg_jax.run.rundir import RunDir
from mtnlg_jax.train import banner, faults, resume
from mtnlg_jax.train import metrics as metrics_lib
from mtnlg_jax.train.state import make_setup, pipeline_order
from mtnlg_jax.train.periodic import Evaluator, Saver, due
from mtnlg_jax.train.pgle import ProfileGuided, count_starts
from mtnlg_jax.train.profile import StepProfile
from mtnlg_jax.train.stragglers import Stragglers
from mtnlg_jax.train.reporter import Reporter
from mtnlg_jax.train.step import make_eval_step, make_train_step
from mtnlg_jax.train.watchdog import Watchdog


def open_data(config):
    """Train and validation blends of data.sources; DataError naming the file if unusable
    (launch/train.py checks data.tokenizer against model.vocab_size before this)."""
    datasets = loader_lib.open_datasets(config)
    return datasets['train'], datasets['valid']


class CompiledSteps:
    """The train step compiled ahead of time once per (micro-step count, drill): the ramp-up
    changes the count, a fault drill (see make_train_step) swaps in a variant for one step.
    The evaluation step too, on first use: compiles happen here, where the loop does not
    watch for stalls. Each compile ends with every process waiting for the others: processes
    compile at different speeds (one reads the compilation cache, another misses it), and a
    peer's compile must not count against the next watched phase."""

    def __init__(self, config, setup, mesh, state):
        self.config, self.setup, self.mesh, self.state = config, setup, mesh, state
        self._compiled = {}
        self.profiled = {}  # micro-step count -> compiler options (train/pgle.py's profile)

    def __contains__(self, micro_steps):
        return (micro_steps, None) in self._compiled

    def __call__(self, micro_steps, drill=None):
        key = (micro_steps, drill)
        if key not in self._compiled:
            batch = loader_lib.abstract_train_batch(self.config, self.mesh, micro_steps)
            step = make_train_step(self.config, self.setup, inject=drill)
            lowered = step.lower(self.state, *batch, jnp.float32(0))
            options = self.profiled.get(micro_steps) if drill is None else None
            self._compiled[key] = lowered.compile(options)
            distributed.wait_for_peers(f'train step {key} compiled')
        return self._compiled[key]

    def recompile(self, micro_steps, options):
        """The train step of `micro_steps` compiled again with these compiler options: a
        profile's instruction names are that program's, so another micro-step count (the
        batch ramp-up), a drill's variant and the evaluation step keep XLA's own schedule."""
        self.profiled[micro_steps] = options
        self._compiled.pop((micro_steps, None), None)
        self(micro_steps)

    def for_batch(self, batch, drill, report):
        """The step of `batch`'s micro-step count (a new count's compile is reported)."""
        if batch.micro_steps not in self:
            start = time.perf_counter()
            self(batch.micro_steps)
            report.compiled(batch, time.perf_counter() - start)
        return self(batch.micro_steps, drill)

    def first_step(self, position, then):
        """Compile the step of the first batch, timed; `then(seconds)` (the banner)."""
        train_cfg = self.config.train
        start = time.perf_counter()
        first_batch = rampup.global_batch_at(
            train_cfg, self.config.model.seq_len, position.counters['samples_consumed']
        )
        self(first_batch // (train_cfg.micro_batch * config_lib.replicas(self.config.mesh)))
        then(time.perf_counter() - start)

    def evaluation(self, params, *buffers):
        if 'evaluation' not in self._compiled:
            tokens, _ = loader_lib.abstract_train_batch(
                self.config, self.mesh, self.config.train.micro_steps
            )
            step = make_eval_step(self.config, self.setup)
            lowered = step.lower(params, tokens, *buffers)
            self._compiled['evaluation'] = lowered.compile()
            distributed.wait_for_peers('evaluation step compiled')
        return self._compiled['evaluation']


def train(config, workdir, identity=None):
    """Train a resolved config in workdir, resuming from its newest checkpoint if it has one.
    Raises DataError, CheckpointError or ConfigError (data.eod_id with no tokenizer to take
    it from) before anything is written, NonFiniteError after train.max_consecutive_skips
    non-finite steps, SaveFailedError after a failed save (checkpoint.on_save_error=stop),
    storage.StorageError after metrics or the loss curve the storage refused (a full disk). A
    stalled phase ends the process (train/watchdog.py). identity: what the workdir records of
    the run (identity.json; launch/train.py checks it against the workdir's before). Returns
    the final state."""
    config = packing.resolve_eod_id(config)
    train_data, valid_data = open_data(config)
    mesh = mesh_from_config(config)
    setup = make_setup(config, mesh)
    checkpoints = open_checkpoints(config, workdir)
    train_cfg, primary = config.train, distributed.is_primary()
    with jax.set_mesh(mesh), faults.StopSignals() as stop_signals:
        position = resume.restore_or_init(config, setup, checkpoints, log=say_if(primary))
        os.makedirs(workdir, exist_ok=True)  # every process: checkpoints go under it
        if primary:
            RunDir(workdir).write_config(config.to_dict())
            if identity is not None:
                RunDir(workdir).write_identity(identity)
        first_step = position.step
        compiled = CompiledSteps(config, setup, mesh, position.state)
        compiled.first_step(position, banner_of(config, setup, train_data, primary))
        drills = faults.drills_of(train_cfg)
        guard = faults.StepGuard.of(train_cfg, position.counters['skipped_steps'])
        report = Reporter(config, workdir, position, *throughput_figures(config, setup))
        batches = loader_lib.TrainBatches(config, train_data, mesh, samples_of(position))
        with watchdog_for(config) as watchdog:
            in_layer_order = pipeline_order(config, setup, to='layer')  # what checkpoints hold
            saver = Saver(config, checkpoints, in_layer_order, guard, watchdog)
            evaluator = Evaluator(config, compiled, valid_data, mesh, report, watchdog)
            starts = count_starts(config, first_step, samples_of(position))
            guided = ProfileGuided(config, workdir, starts, report.say)
            profile = StepProfile(config, workdir, report.say_everywhere, after=guided.windows)
            stragglers = Stragglers(config, report.say)
            while position.step < train_cfg.steps:
                step = position.step + 1
                with profile.step(step), guided.step(step):
                    with watchdog.phase('batch', f'step {step}'), profile.phase('batch'):
                        faults.hang_if_drilled(config, first_step, step)
                        reading = time.perf_counter()
                        batch = next(batches)
                        stragglers.batch_read(time.perf_counter() - reading)
                    with watchdog.phase('step', f'step {step}'), profile.phase('step'):
                        with watchdog.unwatched():  # a new batch size or a drill compiles
                            train_step = compiled.for_batch(batch, drills.pop(step, None), report)
                        position, step_metrics = take_step(train_step, position, batch, config)
                        faults.kill_if_drilled(config, first_step, step, checkpoints)
                        report.stepped(step_metrics)
                        guard.push(step, step_metrics)
                        stopping = stop_requested(checkpoints, stop_signals, step)
                        if due(train_cfg.log_every, step, train_cfg.steps) or stopping:
                            position = guard.settle(position)
                            report.log(position, batch, step_metrics)
                    # before the save: its asynchronous writing would share the host with
                    # the comparison's probe
                    stragglers.maybe_compare(step, position.state)
                    report.relative_speed = stragglers.speeds, stragglers.cost_s
                    with profile.phase('save'):
                        position = saver.maybe_save(step, position, force=stopping)
                profile.stepped(step, position.state)
                guided.stepped(step, position.state, compiled, batch.micro_steps)
                if guard.error or saver.error:
                    break
                if stopping:
                    report.say_everywhere(
                        f'stopped      at step {step} on request: checkpoint saved; '
                        f'the same command resumes it'
                    )
                    break
                evaluator.maybe_run(step, position)
                if guard.spike:  # a restore: not watched
                    position, batches = roll_back(
                        config, setup, checkpoints, position, guard, report, batches
                    )
            profile.close(position.state)  # a run that ended inside the profiled steps
            guided.close()
            stragglers.close()
            with watchdog.phase('step', 'the last step'):
                guard.flush()
            with watchdog.phase('batch', 'closing the data reader'):
                batches.close()
            metrics_path = report.close()
            saver.finish()
        checkpoints.close()
    faults.raise_if_failed(guard.error, saver.error)
    if report.writer.failed:
        raise storage.StorageError(report.writer.failed)
    if primary:
        write_loss_curve(workdir, metrics_path)
    return position.state


def open_checkpoints(config, workdir):
    checkpoints = checkpoint_lib.Checkpoints(workdir, keep=config.checkpoint.keep)
    drilled = config.checkpoint.inject_save_error_process in (-1, jax.process_index())
    checkpoints.fail_save_at = config.checkpoint.inject_save_error_at_step * drilled  # a drill
    return checkpoints


def say_if(primary):
    return print if primary else lambda _: None


def samples_of(position):
    return position.counters['samples_consumed']


def banner_of(config, setup, train_data, primary):
    """What prints the start banner once the first step compiled (process 0 alone)."""

    def show(compile_seconds):
        if primary:
            for line in banner.lines(config, setup, compile_seconds, train_data):
                print(line, flush=True)

    return show


def throughput_figures(config, setup):
    """(model FLOPs per token, the device's peak TFLOP/s or None): what MFU is made of."""
    num_params = counts.count_params(setup.layer_abstract_state['params'])
    flops_per_token = counts.model_flops_per_token(config.model, num_params)
    return flops_per_token, devices.device_peak_tflops(jax.devices()[0], config.model.compute_dtype)


def take_step(train_step, position, batch, config):
    """(position after the step, its device metrics): the learning rate follows the tokens
    seen once the step is done."""
    seq_len = config.model.seq_len
    tokens_after = position.counters['tokens_seen'] + batch.global_batch * seq_len
    state, step_metrics = train_step(
        position.state, batch.tokens, batch.row_ids, jnp.float32(tokens_after)
    )
    return position.after(state, batch.global_batch, seq_len), step_metrics


def stop_requested(checkpoints, stop_signals, step):
    """A stop on request: SIGTERM / SIGINT here, or JAX's preemption notice across processes."""
    if jax.process_count() > 1:
        return checkpoints.reached_preemption(step)
    return stop_signals.requested


def write_loss_curve(workdir, metrics_path):
    run_dir = RunDir(workdir)
    png = run_dir.loss_png
    try:
        metrics_lib.plot_loss_curve(metrics_path, png, title=os.path.basename(workdir.rstrip('/')))
    except OSError as error:
        refused = storage.refusal(error)
        if refused is None:
            raise
        raise storage.StorageError(f'{png} not written: {refused}') from None
    print(f'wrote {metrics_path}, {png} and tensorboard events in {run_dir.tensorboard}')


def watchdog_for(config):
    """The progress watchdog of this process (train.hang_timeout_s, train.hang_floor_s); a
    phase that waits on the devices of several processes gets the heartbeat timeout more."""
    several = jax.process_count() > 1
    train_cfg = config.train
    watchdog = Watchdog(
        train_cfg.hang_timeout_s,
        train_cfg.hang_floor_s,
        peer_grace_s=config.distributed.heartbeat_timeout_s if several else 0.0,
        name=f'process {jax.process_index()} of {jax.process_count()}',
    )
    # The first evaluation: about eval_batches steps' time.
    watchdog.estimates['evaluation'] = lambda: (
        train_cfg.eval_batches * watchdog.slowest.get('step', 0.0)
    )
    return watchdog


def roll_back(config, setup, checkpoints, position, guard, report, batches):
    """After a loss spike: (position, batches) of the newest checkpoint with the data moved
    past the spike (resume.roll_back), or as they were when there is no checkpoint."""
    spike_step, spike_loss, mean = guard.spike
    guard.spike = None
    rolled = resume.roll_back(config, setup, checkpoints, position)
    if rolled is None:
        report.say(f'loss spike at step {spike_step}: no checkpoint to go back to')
        return position, batches
    report.say(
        f'loss spike at step {spike_step}: {spike_loss:.4f} > '
        f'{config.train.spike_factor} x running mean {mean:.4f}; rolled back to step '
        f'{rolled.step}, data moved on to sample {rolled.counters["samples_consumed"]}'
    )
    report.moved_to(rolled)
    return rolled, batches.reopened_at(samples_of(rolled))  # the data position moved
