"""The model's pieces an engine runs, and the per-micro-batch input each chunk receives.

Imports flow one way, config -> parallel -> model -> train -> launch (docs/design.md, "Layers"):
the engines (engine.py, pipeline.py, gpipe.py) sit below the model and import nothing from it.
The train step builds these functions from its model (`gpt.stage_functions(graphdef, axes)`)
and passes them in. An engine sees the parameters as a plain dict: the block stack under
'blocks', stacked on a leading layer axis, and the rest (`shared_params`), which every stage
holds.

    embed(shared, batch)                      batch.tokens (..., seq) -> hidden (..., seq,
                                              embed): token (+ position) embeddings, dropout
    apply_blocks(chunk, hidden, batch,        consecutive blocks scanned over hidden, layer
                 first_layer, remat)          first_layer first (dropout), each under the
                                              policy `remat` names ('none': none)
    head_loss_sum(shared, hidden, batch)      summed loss of batch.labels under hidden (rows,
                                              seq, embed), each weighted by batch.loss_mask:
                                              final norm, tied head and cross-entropy fused
    logits_loss_sum(shared, hidden, batch)    the same through the whole fp32 logits, which
                                              autodiff keeps (GPipe order's head)

Which piece reads which field: embed the tokens, positions (learned positions) and dropout
keys; apply_blocks the positions (rope), segment ids (the attention's mask: plain, cuDNN or
flash) and dropout keys; the heads the labels and loss mask. An engine indexes each field by
micro-batch on the stage that runs the piece; none is (seq x seq): masks are made from the
segment ids inside the attention.

`batch` is a MicroBatch: everything a chunk may need of its micro-batch, indexed by the engine
(`batch.at(micro)`) and never read from the parameters' shapes. Optional fields are None when
they take their default, so a model that has no use for one never sees it:

    windows      (rows, seq + 1) int32 the token windows: `tokens` (inputs) are their first
                                       seq, `labels` (next tokens) their last seq
    positions    (rows, seq) int32     None: 0 .. seq - 1 in every row
    segment_ids  (rows, seq) int32     None: one document a row (packed documents: which)
    loss_mask    (rows, seq) float32   None: every label counts
    row_keys     (rows,) PRNG keys     None: no dropout (one key per sequence)
"""

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Per-micro-batch inputs (see the module docstring); leading axes (micro-batches, ...)
    until an engine picks one with `at`."""

    windows: Any
    positions: Any = None
    segment_ids: Any = None
    loss_mask: Any = None
    row_keys: Any = None

    @property
    def tokens(self):
        return self.windows[..., :-1]

    @property
    def labels(self):
        return self.windows[..., 1:]

    def at(self, micro):
        """Micro-batch `micro` (an index into the leading axis): a view that indexes each
        field when it is read, so a piece that reads only the tokens slices only those."""
        return Picked(self, micro)

    def map(self, fn):
        """fn applied to every field that is not None."""
        return jax.tree.map(fn, self)

    def token_count(self):
        """Labels that count in the loss (fp32 scalar)."""
        if self.loss_mask is None:
            return jnp.asarray(math.prod(self.windows.shape[:-1]) * self.seq, jnp.float32)
        return self.loss_mask.astype(jnp.float32).sum()

    @property
    def micro_batches(self):
        return self.windows.shape[0]

    @property
    def rows(self):
        return self.windows.shape[-2]

    @property
    def seq(self):
        return self.windows.shape[-1] - 1


class Picked:
    """One micro-batch of a MicroBatch (MicroBatch.at): the same attributes, each read as
    field[micro]; not a pytree (hand a jax transformation an Inputs instead)."""

    def __init__(self, batch, micro):
        self._batch, self._micro = batch, micro

    @property
    def tokens(self):
        return self._batch.windows[self._micro, :, :-1]

    @property
    def labels(self):
        return self._batch.windows[self._micro, :, 1:]

    def __getattr__(self, name):  # positions, segment_ids, loss_mask, row_keys
        value = getattr(self._batch, name)
        return None if value is None else value[self._micro]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """A micro-batch's inputs given field by field (a pytree: what crosses a checkpoint or
    a scan), None where not given; the same attributes as MicroBatch."""

    tokens: Any = None
    labels: Any = None
    positions: Any = None
    segment_ids: Any = None
    loss_mask: Any = None
    row_keys: Any = None


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model's pieces (the module's table), built by the model and passed in by the
    engines' caller: the parallel layer, below the model, never imports it."""

    embed: Callable
    apply_blocks: Callable
    head_loss_sum: Callable
    logits_loss_sum: Callable
    remat: str  # 'none', 'full' or 'selective': what apply_blocks recomputes per layer
    remat_policy: Any  # remat's jax.checkpoint policy (None for 'none')
    dtype: Any  # the compute dtype of the activations
    param_axes: Any = None  # logical axis names of every parameter (the accumulators' layout)


def shared_params(params):
    """Every parameter outside the block stack (embeddings, final norm): each stage holds all."""
    return {k: v for k, v in params.items() if k != 'blocks'}
