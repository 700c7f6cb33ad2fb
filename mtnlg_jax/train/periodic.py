"""What the loop runs on a cadence, each deciding its own: checkpoints and evaluation.

    saver.maybe_save(step, position, force=stopping)   every checkpoint.every, at the end,
                                                       on a stop; settles the position first
    evaluator.maybe_run(step, position)                every train.eval_every, at the end

Both run in a phase of the progress watchdog (train/watchdog.py); their compiles do not.
"""

import sys
import time

from tqdm import tqdm

from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.train import resume


def due(every, step, last_step):
    """Whether a cadence of `every` steps (0: only the last) falls on `step`."""
    return bool(every and step % every == 0) or step == last_step


def evaluate(config, eval_step, params, dataset, mesh, *buffers):
    """Mean validation loss over `train.eval_batches` fixed global batches of the validation
    split, laid out in micro-batches as a train step's (the pipeline needs them so); buffers:
    the model's (state['buffers']), for a model that has them."""
    size, micro_steps = config.train.global_batch, config.train.micro_steps
    loss_sum, count = 0.0, 0.0
    for i in range(config.train.eval_batches):
        tokens, _ = loader_lib.place_train_batch(dataset, mesh, i * size, size, micro_steps)
        batch_loss, batch_count = eval_step(params, tokens, *buffers)
        loss_sum, count = loss_sum + float(batch_loss), count + float(batch_count)
    return loss_sum / count


class Evaluator:
    """The validation loss every `train.eval_every` steps and after the last, reported."""

    def __init__(self, config, compiled, dataset, mesh, report, watchdog):
        self.config, self.compiled, self.dataset, self.mesh = config, compiled, dataset, mesh
        self.report, self.watchdog = report, watchdog

    def maybe_run(self, step, position):
        if not due(self.config.train.eval_every, step, self.config.train.steps):
            return
        start = time.perf_counter()
        with self.watchdog.phase('evaluation', f'after step {step}'):
            params = position.state['params']
            buffers = [position.state['buffers']] if 'buffers' in position.state else []
            with self.watchdog.unwatched():
                eval_step = self.compiled.evaluation(params, *buffers)
            loss = evaluate(self.config, eval_step, params, self.dataset, self.mesh, *buffers)
        self.report.evaluated(position, loss, time.perf_counter() - start)


class Saver:
    """Checkpoints every `checkpoint.every` steps, after the last and on a stop, in layer
    order. A failed save sets `error` (checkpoint.on_save_error=stop) or warns (continue).
    After a non-finite stop or a loss spike it saves nothing: the newest checkpoint is the
    last good one, and a rollback reads it once the saves in flight are done."""

    def __init__(self, config, checkpoints, in_layer_order, guard, watchdog):
        self.config, self.checkpoints, self.in_layer_order = config, checkpoints, in_layer_order
        self.guard, self.watchdog = guard, watchdog
        self.error = None

    def maybe_save(self, step, position, force=False):
        """The position, settled (the guard read up to `step`) when a save is due."""
        guard, checkpoints = self.guard, self.checkpoints
        with self.watchdog.phase('save', f'checkpoint of step {step}'):
            saving = due(self.config.checkpoint.every, step, self.config.train.steps) or force
            if saving:
                position = guard.settle(position)
            try:
                checkpoints.wait() if guard.spike else checkpoints.check_saves()
                if saving and not (guard.error or guard.spike):
                    meta = resume.checkpoint_meta(self.config, position.counters)
                    checkpoints.save(step, self.in_layer_order(position.state), meta)
            except checkpoint_lib.SaveError as error:
                self.error = failed_save(self.config, error)
        return position

    def finish(self):
        """Wait for the saves in flight (also after non-finite steps)."""
        with self.watchdog.phase('save', 'the saves in flight'):
            try:
                self.checkpoints.wait()
            except checkpoint_lib.SaveError as error:
                self.error = self.error or failed_save(self.config, error)


def failed_save(config, error):
    """The message that stops the run after a failed save (checkpoint.on_save_error=stop), or
    None after a warning (continue): the run saves again at its next checkpoint."""
    if config.checkpoint.on_save_error == 'stop':
        return f'{error}; the run stops (checkpoint.on_save_error=stop)'
    # tqdm.write: the line does not land inside process 0's progress bar.
    tqdm.write(f'warning: {error}; the run goes on (checkpoint.on_save_error=continue)', sys.stderr)
    return None
