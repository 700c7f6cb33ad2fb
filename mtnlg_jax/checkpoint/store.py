"""Sharded, asynchronous orbax checkpoints of the train state that restore onto any layout.

    <workdir>/checkpoints/<step>/state   params, optimizer state, step: tensorstore arrays,
                                         each process writing only its own shards
    <workdir>/checkpoints/<step>/meta    JSON: samples consumed, tokens seen, skipped steps,
                                         the RNG seed, the resolved config, the tokenizer's
                                         identity
    <workdir>/checkpoints/<step>.orbax-checkpoint-tmp-*   a save in flight (or killed in one)

Saving: `save` blocks only while the arrays are copied off the devices, then orbax writes them
in a background thread into a temporary directory and renames it to `<step>` once every
process has finished: a process killed mid-save leaves only a `*-tmp-*` directory, which
orbax never lists as a step, so restore takes the newest complete checkpoint.

Restoring: the arrays are stored in their logical shapes, whatever the layout that wrote them,
so they are read straight into the shardings of the layout that restores (orbax reshards): a
run saved under (data 4, tensor 2) resumes under (data 2, tensor 4) with no conversion step.
Before reading, the stored shapes are checked against the model's; a different model is a
`CheckpointError` naming the first mismatched array. Dimensions the caller marks resizable
(the padded vocabulary, whose padding depends on the tensor size) may differ: orbax pads or
truncates them (the padding rows never reach the loss). `restore_newest` skips unreadable
checkpoints with a warning naming each; nothing here deletes a checkpoint that failed to
restore.
"""

import contextlib
import glob
import logging
import os
import sys

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from mtnlg_jax.checkpoint.shared_failure import FailedSave, SharedFailure, in_chain, with_commits
from mtnlg_jax.run import storage
from mtnlg_jax.run.rundir import RunDir

TMP_MARKER = '.orbax-checkpoint-tmp'
SET_ASIDE_SUFFIX = '.unusable'
NOT_RESIZABLE = -1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the one-line message names it and why."""


class SaveError(RuntimeError):
    """A checkpoint that could not be written; the one-line message names it and the cause."""


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs that carry the shardings to restore into."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_tree,
        shardings,
    )


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs a warning each time a manager opens read-only (that it will not save), and
    errors of its own for unreadable files that the caller reports in one line: noise on a
    tool's stderr, whose error lines must stand alone."""
    logger = logging.getLogger('absl')  # orbax logs through absl, absl through this logger
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _NoSaveTracebacks(logging.Filter):
    """Drops the tracebacks orbax logs from its threads when a save fails: the SaveError's
    one line says what failed and why, and stderr keeps it as its last line."""

    def filter(self, record):
        return not (record.exc_info and f'{os.sep}orbax{os.sep}' in record.pathname)


def checkpoint_directory(path):
    """The checkpoints of `path`: `path/checkpoints` when `path` is a workdir, else `path`."""
    path = os.path.abspath(path)
    nested = RunDir(path).checkpoints
    return nested if os.path.isdir(nested) else path


def _path_name(key_path):
    """'params/blocks/mlp/in_kernel' from a key path, whatever container each level was
    (dicts, tuples, optax's named tuples: orbax stores the latter as dicts)."""
    names = []
    for key in key_path:
        for attribute in ('key', 'name', 'idx'):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
    return '/'.join(names)


def _shapes_by_name(tree):
    is_array = lambda x: hasattr(x, 'shape') and hasattr(x, 'dtype')  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_array)
    return {_path_name(path): tuple(leaf.shape) for path, leaf in leaves if is_array(leaf)}


def first_line(error):
    text = str(error).strip().splitlines()
    return f'{type(error).__name__}: {text[0][:200] if text else ""}'


class Checkpoints:
    """The checkpoints of one workdir: save every `every` steps and at the end, keep `keep`.

    `directory` (instead of a workdir) opens another run's checkpoints, e.g. read-only for
    `checkpoint.init_from`."""

    def __init__(self, workdir, keep=3, *, directory=None, read_only=False):
        self.directory = os.path.abspath(directory or RunDir(workdir).checkpoints)
        self.keep, self.read_only = keep, read_only
        self.fail_save_at = 0  # the save drill's step (0: none)
        self._saving = None  # step of the save in flight
        self._shared = SharedFailure(self._cause)
        self._manager = self._open()
        absl = logging.getLogger('absl')  # orbax logs through absl, absl through this logger
        if not read_only and not any(isinstance(f, _NoSaveTracebacks) for f in absl.filters):
            absl.addFilter(_NoSaveTracebacks())
        if not read_only:
            storage.quiet_background_noise()  # a full disk's tracebacks from orbax's threads

    def _open(self):
        # create=False: nothing is written to the workdir until the first save.
        state = with_commits(
            ocp.StandardCheckpointHandler(),
            lambda: bool(self.fail_save_at) and self._saving == self.fail_save_at,
            self._shared,
        )
        meta = with_commits(ocp.JsonCheckpointHandler(), lambda: False, self._shared)
        handlers = dict(state=state, meta=meta)
        with _quiet_orbax() if self.read_only else contextlib.nullcontext():
            shared = self._shared.needed() and not self.read_only
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                create=False,
                read_only=self.read_only,
                async_options=ocp.AsyncOptions(
                    barrier_sync_fn=self._shared.barrier_sync_fn() if shared else None
                ),
            )
            return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self):
        return self._manager.latest_step()

    def all_steps(self):
        return list(self._manager.all_steps())

    def incomplete(self):
        """Directories of saves that never finished (a process killed while writing)."""
        return sorted(glob.glob(os.path.join(self.directory, f'*{TMP_MARKER}*')))

    def save(self, step, state, meta):
        """Start writing `state` and `meta` at `step`; training goes on while it writes.
        SaveError if the previous save failed, or this one's blocking part did."""
        self.wait()  # the previous save's failure is named as its own
        self._set_aside_steps_from(step)
        self._saving = step
        self._shared.start()
        with self._failures_named():
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )

    def check_saves(self):
        """SaveError if the save in flight has failed; returns at once while it runs."""
        if self._saving is not None and not self._manager.is_saving_in_progress():
            self.wait()

    @contextlib.contextmanager
    def _failures_named(self):
        """Orbax's error of a failed save as one SaveError line (_NoSaveTracebacks keeps
        orbax's own log of it off stderr); the manager is opened again, as the failed one
        raises the same error at every later wait."""
        try:
            yield
        except Exception as error:
            where = self._where()
            self._saving = None
            self._manager = self._open()
            newest = self._manager.latest_step()
            raise SaveError(
                f'checkpoint {where} was not saved: {self._cause(error)}; the newest complete '
                f'checkpoint is ' + (f'step {newest}' if newest is not None else 'none')
            ) from error

    def _where(self):
        where = self.directory
        return where if self._saving is None else os.path.join(where, str(self._saving))

    def _cause(self, error):
        """Why the save failed, in one line: every process of a run names the same cause
        (the lowest failing process's, shared_failure.py)."""
        shared = in_chain(error, FailedSave)
        if shared is not None:
            return storage.noted(shared.cause)
        refused = storage.refusal(error)
        if not refused:
            return first_line(error)
        # orbax's text of a refusal is tensorstore's, hundreds of characters long
        cause = refused + (' (a drill)' if 'a drill' in str(error) else '')
        room = storage.free_space(self._where())
        if self._shared.needed():
            cause += f' on process {jax.process_index()}'
        return storage.noted(cause + (f'; {room}' if room else ''))

    def _set_aside_steps_from(self, step):
        """Steps at or past `step` exist only if restore skipped them as unreadable: they are
        renamed `<step>.unusable` (kept for inspection, never deleted) so the new save can
        take their place and the step list stays in order."""
        stale = [s for s in self.all_steps() if s >= step]
        if not stale:
            return
        self._manager.wait_until_finished()
        for s in stale if jax.process_index() == 0 else ():  # one process renames
            old = os.path.join(self.directory, str(s))
            new = old + SET_ASIDE_SUFFIX
            while os.path.exists(new):
                new += SET_ASIDE_SUFFIX
            os.rename(old, new)
            print(f'warning: checkpoint {old} set aside as {new}', file=sys.stderr, flush=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices('mtnlg_jax: checkpoints set aside')
        self._manager.reload()

    def _stored_tree(self, step):
        stored_tree = self._manager.item_metadata(step)['state']
        if stored_tree is None:  # corrupted, not a model mismatch: restore_newest skips it
            raise FileNotFoundError(f'no readable array metadata in {self.directory}/{step}')
        return stored_tree

    def check_fits(self, abstract_state, step, resizable=None, partial=False):
        """CheckpointError naming the first array of `abstract_state` (parameters first, then in
        tree order) that the checkpoint at `step` lacks or holds in another shape. `resizable`:
        a tree like `abstract_state` with, per array, the one dimension that may differ (or
        -1). partial: the checkpoint may hold more than `abstract_state` asks for."""
        stored = _shapes_by_name(self._stored_tree(step))
        expected = _shapes_by_name(abstract_state)
        allowed = {}
        if resizable is not None:
            leaves = jax.tree_util.tree_leaves_with_path(resizable)
            allowed = {_path_name(path): dim for path, dim in leaves}
        where = os.path.join(self.directory, str(step))
        # Parameters first: a model of another shape is named by its parameter, not by the
        # Adam moment that happens to sort before it.
        for name, shape in sorted(
            expected.items(), key=lambda item: not item[0].startswith('params')
        ):
            if name not in stored:
                raise CheckpointError(f'checkpoint {where} has no array {name} (shape {shape})')
            differs = [d for d, (a, b) in enumerate(zip(stored[name], shape)) if a != b]
            resizes = differs == [allowed.get(name, NOT_RESIZABLE)]
            if len(stored[name]) != len(shape) or (differs and not resizes):
                raise CheckpointError(
                    f'checkpoint {where} does not fit this model: {name} has shape '
                    f'{stored[name]} in the checkpoint but {shape} in the model'
                )
        extra = sorted(set(stored) - set(expected))
        if extra and not partial:
            raise CheckpointError(f'checkpoint {where} holds {extra[0]}, which the model lacks')

    def restore(self, abstract_state, step=None, *, resizable=None):
        """(state, meta) of `step` (default: the newest), laid out as `abstract_state` says.
        Raises CheckpointError if the shapes do not fit (see `check_fits`)."""
        step = self.latest_step() if step is None else step
        self.check_fits(abstract_state, step, resizable)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                # strict=False lets orbax pad or cut the dimensions check_fits allowed.
                state=ocp.args.StandardRestore(abstract_state, strict=resizable is None),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored['state'], restored['meta']

    def restore_params(self, abstract_params, step):
        """The parameters alone of `step`, laid out as `abstract_params` says: evaluation,
        generation and export leave the optimizer moments (twice the parameters' bytes) on
        disk. CheckpointError if they do not fit the model."""
        return self.restore_parts(dict(params=abstract_params), step)['params']

    def restore_parts(self, abstract_parts, step):
        """The parts of the state `abstract_parts` names ({'params': ..., 'buffers': ...}), laid
        out as it says, the rest left on disk; CheckpointError if they do not fit."""
        with _quiet_orbax():
            return self._restore_parts(abstract_parts, step)

    def _restore_parts(self, target, step):
        self.check_fits(target, step, partial=True)
        # The standard handler reads whole trees only; orbax's PyTree handler (same files)
        # reads the subtree asked for.
        reader = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(create=False, read_only=True),
            item_handlers=dict(state=ocp.PyTreeCheckpointHandler()),
        )
        try:
            restored = reader.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=True,
                    )
                ),
            )
        finally:
            reader.close()
        return restored['state']

    def restore_newest(self, abstract_state, *, resizable=None):
        """(step, state, meta) of the newest checkpoint that reads, or None if there is none.
        Unreadable ones are skipped with a warning on stderr naming each; a model mismatch,
        or no readable checkpoint at all, is a CheckpointError. Nothing is deleted."""
        steps = sorted(self.all_steps(), reverse=True)
        unreadable = []
        for step in steps:
            where = os.path.join(self.directory, str(step))
            try:
                state, meta = self.restore(abstract_state, step, resizable=resizable)
            except CheckpointError:
                raise
            except Exception as error:  # a corrupted or truncated file: any reader error
                unreadable.append(str(step))
                print(
                    f'warning: skipping unreadable checkpoint {where} ({first_line(error)})',
                    file=sys.stderr,
                    flush=True,
                )
                continue
            return step, state, meta
        if unreadable:
            raise CheckpointError(
                f'no usable checkpoint in {self.directory}: step(s) {", ".join(unreadable)} '
                f'are unreadable (left on disk)'
            )
        return None

    def reached_preemption(self, step):
        """True on every process once the cluster has announced a preemption (multi-process
        runs under jax.distributed; a single process handles its own signals)."""
        return self._manager.reached_preemption(step)

    def wait(self):
        """Block until every save in flight is on disk; SaveError if one failed."""
        with self._failures_named():
            self._manager.wait_until_finished()
        self._saving = None

    def close(self):
        self._manager.close()
