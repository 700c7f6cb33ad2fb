"""Where a run starts: its own newest checkpoint, another run's, or a fresh state.

    workdir has a usable checkpoint?  -> resume it (any layout), counters from its meta
    else checkpoint.init_from=PATH?   -> parameters (or, with checkpoint.init_full_state, the
                                         whole state and counters) of PATH's newest checkpoint
    else                              -> init_state from train.seed

After a loss spike, `roll_back` goes back to the newest checkpoint with the data moved on.

The counters are what the data and the schedule need to continue exactly: samples consumed
(the loader's position), tokens seen (the learning-rate schedule), steps skipped as
non-finite. The RNG state is the step itself: dropout keys are fold_in(key(train.seed + 1),
step, row), so a checkpoint stores only the seed (in its config and as `rng_seed`).
"""

import dataclasses
import os

import jax
import optax

from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.data import tokenizer as tokenizer_lib
from mtnlg_jax.train.state import init_state, pipeline_order

COUNTERS = ('samples_consumed', 'tokens_seen', 'skipped_steps')


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run stands: `step` steps done, the train state after them, and the counters
    (a dict of COUNTERS). Restore, initialisation and rollback each return one; the loop
    replaces it after every step."""

    step: int
    state: dict
    counters: dict

    def after(self, state, global_batch, seq_len):
        """The position one step of `global_batch` sequences later, ending in `state`."""
        counters = dict(
            self.counters,
            samples_consumed=self.counters['samples_consumed'] + global_batch,
            tokens_seen=self.counters['tokens_seen'] + global_batch * seq_len,
        )
        return Position(self.step + 1, state, counters)

    def counted(self, skipped_steps):
        """The same position with the skipped-step count StepGuard keeps during the run."""
        return dataclasses.replace(self, counters=dict(self.counters, skipped_steps=skipped_steps))


def fresh_counters():
    return dict.fromkeys(COUNTERS, 0)


def checkpoint_meta(config, counters):
    """What a checkpoint needs besides the arrays to resume exactly."""
    tokenizer = None
    if os.path.exists(config.data.tokenizer):
        try:  # sentencepiece or GPT-2 BPE files; the checkpoint is saved either way
            tokenizer = tokenizer_lib.load(config.data.tokenizer).identity
        except tokenizer_lib.TokenizerError:
            pass
    return dict(
        counters,
        rng_seed=config.train.seed,  # dropout keys: fold_in(key(seed + 1), step, row)
        config=config.to_dict(),
        tokenizer_identity=tokenizer,
    )


def resizable_dims(setup):
    """Per state array, the dimension a checkpoint may hold in another size: the padded
    vocabulary (its padding is a multiple of 128 x tensor, so it changes with the layout)."""
    vocab_dims = jax.tree.map(
        lambda axes: axes.index('vocab') if 'vocab' in axes else checkpoint_lib.NOT_RESIZABLE,
        setup.logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    opt_dims = optax.tree_map_params(
        setup.optimizer,
        lambda _, dim: dim,
        setup.abstract_state['opt_state'],
        vocab_dims,
        transform_non_params=lambda _: checkpoint_lib.NOT_RESIZABLE,
    )
    dims = dict(params=vocab_dims, opt_state=opt_dims, step=checkpoint_lib.NOT_RESIZABLE)
    if 'buffers' in setup.abstract_state:
        not_resizable = lambda _: checkpoint_lib.NOT_RESIZABLE  # noqa: E731
        dims['buffers'] = jax.tree.map(not_resizable, setup.abstract_state['buffers'])
    return dims


def _restore_newest(config, checkpoints, setup):
    """(step, state, meta) of the newest readable checkpoint, on this layout, with the blocks
    put back in the pipeline's stage-major order (checkpoints hold plain layer order)."""
    abstract = checkpoint_lib.abstract_with_shardings(
        setup.layer_abstract_state, setup.layer_state_shardings
    )
    found = checkpoints.restore_newest(abstract, resizable=resizable_dims(setup))
    if found is None:
        return None
    step, state, meta = found
    return step, pipeline_order(config, setup, to='schedule')(state), meta


def _counters_of(meta):
    return {key: int(meta.get(key, 0)) for key in COUNTERS}


def restore_or_init(config, setup, checkpoints, log=print):
    """The Position to start from; CheckpointError if a checkpoint does not fit."""
    found = _restore_newest(config, checkpoints, setup)
    if found is not None:
        step, state, meta = found
        incomplete = checkpoints.incomplete()
        note = f'; ignored incomplete save(s): {", ".join(incomplete)}' if incomplete else ''
        log(f'resumed      from step {step} of {checkpoints.directory} (newest complete{note})')
        return Position(int(state['step']), state, _counters_of(meta))
    state, counters = init_state(config, setup), fresh_counters()
    if config.checkpoint.init_from:
        state, counters = _init_from(config, setup, state, counters, log)
    return Position(int(state['step']), state, counters)


def _init_from(config, setup, state, counters, log):
    """The fresh state with another run's parameters (or its whole state) put in."""
    directory = checkpoint_lib.checkpoint_directory(config.checkpoint.init_from)
    if not os.path.isdir(directory):
        raise checkpoint_lib.CheckpointError(
            f'checkpoint.init_from={config.checkpoint.init_from!r}: no such directory'
        )
    source = checkpoint_lib.Checkpoints(None, directory=directory, read_only=True)
    try:
        found = _restore_newest(config, source, setup)
    finally:
        source.close()
    if found is None:
        raise checkpoint_lib.CheckpointError(
            f'checkpoint.init_from={config.checkpoint.init_from!r}: no checkpoint in {directory}'
        )
    step, other, meta = found
    if config.checkpoint.init_full_state:
        state, counters = other, _counters_of(meta)
        what = 'parameters, optimizer state, step and data position'
    else:  # the buffers are the model's too (a router's bias routes at inference)
        state = dict(state, **{k: other[k] for k in ('params', 'buffers') if k in other})
        what = 'parameters' + (' and buffers' if 'buffers' in other else '')
    log(f'initialised  {what} from step {step} of {directory}')
    return state, counters


def roll_back(config, setup, checkpoints, position):
    """After a loss spike at `position`: the Position of the newest checkpoint, with the data
    moved past every batch consumed so far (the spike's among them) and
    train.spike_skip_batches more; None if there is no checkpoint to go back to."""
    checkpoints.wait()
    found = _restore_newest(config, checkpoints, setup)
    if found is None:
        return None
    step, state, meta = found
    skip = config.train.spike_skip_batches * config.train.global_batch
    counters = dict(
        _counters_of(meta),
        samples_consumed=position.counters['samples_consumed'] + skip,
        skipped_steps=position.counters['skipped_steps'],
    )
    return Position(step, state, counters)
