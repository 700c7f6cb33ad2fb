"""The model's pieces an engine runs, and the per-micro-batch input each chunk receives.

Imports flow one way, config -> parallel -> model -> train -> launch (docs/design.md, "Layers"):
the engines (engine.py, pipeline.py, gpipe.py) sit below the model and import nothing from it.
The train step builds these functions from its model (`gpt.stage_functions(graphdef, axes)`)
and passes them in. An engine sees the parameters as a plain dict: the block stack under
'blocks', stacked on a leading layer axis, and the rest (`shared_params`), which every stage
holds.

    embed(shared, batch)                      batch.tokens (..., seq) -> hidden (..., seq,
                                              embed): token (+ position) embeddings, dropout
    apply_blocks(chunk, hidden, batch,        (hidden, values): consecutive blocks scanned
                 first_layer, remat,          over hidden, layer first_layer first (dropout),
                 used=None, taps=None,        each under the policy `remat` names ('none':
                 unroll=False,                none); values: {name: fp32 array} of every
                 [prepared=], offload=True)
                                              declared side value (below), combined over the
                                              chunk's layers by the model; taps: the kernel
                                              matmuls' zero taps (parallel/taps.py), stacked
                                              over the chunk's layers, [] to probe them;
                                              unroll: the scan unrolled (one computation);
                                              prepared: prepare(chunk), given only where
                                              the model has prepare (below); offload:
                                              the policy moves `offload`'s outputs to the
                                              host (False: kept on the device, the
                                              1F1B engine moves them: offload.py)
    prepare(chunk)                            or None: what apply_blocks reads of a chunk
                                              beside it, made once a step before the loop
                                              (FP8's quantized weights); an engine hands it
                                              in as a loop-invariant input, never stashed
    head_loss_sum(shared, hidden, batch)      summed loss of batch.labels under hidden (rows,
                                              seq, embed), each weighted by batch.loss_mask:
                                              final norm, tied head and cross-entropy fused
    logits_loss_sum(shared, hidden, batch)    the same through the whole fp32 logits, which
                                              autodiff keeps (GPipe order's head)

Side values (`values`: {name: SideValue}, empty for a model that emits none): named
per-micro-batch values the block stack emits beside the hidden state, such as a mixture of
experts' load-balancing loss and per-expert token counts (reduce 'sum') or FP8's per-layer amax
(reduce 'max'), each of a fixed shape. Every engine combines them over the chunks, the
micro-batches and the stages, the train step over the data replicas (a slot or bubble that runs
no chunk contributes the identity: 0 for 'sum', -inf for 'max'), and returns them beside the
loss. A differentiable value (always 'sum') is added to what is differentiated: the gradients
are those of loss sum + the sum of every differentiable value, which the train step divides
by the token count as it does the loss; a model that wants its aux loss as a per-token mean
emits it times its micro-batch's token count. A value not differentiable gets no gradient.

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
    order        (rows, seq) int32     None: the natural order; under context parallelism
                                       the global position of each place (parallel/
                                       context.py): tokens and labels are read in this
                                       order, the other fields are given in it, and
                                       attention's causal mask compares these positions
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
    order: Any = None

    @property
    def tokens(self):
        return in_order(self.windows[..., :-1], self.order)

    @property
    def labels(self):
        return in_order(self.windows[..., 1:], self.order)

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
        """The places held here: the order's under context parallelism (in a region manual
        over 'context', this rank's; the windows are whole), else the windows' less one."""
        return self.windows.shape[-1] - 1 if self.order is None else self.order.shape[-1]


class Picked:
    """One micro-batch of a MicroBatch (MicroBatch.at): the same attributes, each read as
    field[micro]; not a pytree (hand a jax transformation an Inputs instead)."""

    def __init__(self, batch, micro):
        self._batch, self._micro = batch, micro

    @property
    def tokens(self):
        return in_order(self._batch.windows[self._micro, :, :-1], self.order)

    @property
    def labels(self):
        return in_order(self._batch.windows[self._micro, :, 1:], self.order)

    def __getattr__(self, name):  # positions, segment_ids, loss_mask, row_keys, order
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
    order: Any = None


def in_order(x, order):
    """x (..., seq) with its places taken in `order` (..., seq) (None: x as it is)."""
    return x if order is None else jnp.take_along_axis(x, order, axis=-1)


@dataclasses.dataclass(frozen=True)
class SideValue:
    """How a side value (the module docstring) is combined: reduce 'sum' or 'max' over
    layers, chunks, micro-batches, stages and replicas; differentiable: whether its sum joins
    the objective (only a 'sum' can); shape: its fixed shape (fp32)."""

    reduce: str = 'sum'
    differentiable: bool = False
    shape: tuple = ()

    def __post_init__(self):
        assert self.reduce in ('sum', 'max'), f'reduce {self.reduce!r}: sum or max'
        assert self.reduce == 'sum' or not self.differentiable, 'a differentiable value sums'

    def identity(self):
        """What a slot that runs nothing contributes: 0 for 'sum', -inf for 'max'."""
        fill = 0.0 if self.reduce == 'sum' else -jnp.inf
        return jnp.full(self.shape, fill, jnp.float32)

    def combine(self, a, b):
        return a + b if self.reduce == 'sum' else jnp.maximum(a, b)

    def over(self, value, axis):
        """Combined over a mesh axis (or a tuple of them) inside a region manual over it (XLA
        rejects a cross-device op over an axis of size 1: those are left out)."""
        axes = tuple(
            a for a in ((axis,) if isinstance(axis, str) else axis) if jax.lax.axis_size(a) > 1
        )
        if not axes:
            return value
        axis = axes[0] if len(axes) == 1 else axes
        return jax.lax.psum(value, axis) if self.reduce == 'sum' else jax.lax.pmax(value, axis)


def identities(declared):
    """{name: identity} of declared ({name: SideValue}): no chunk's values."""
    return {name: side.identity() for name, side in declared.items()}


def combine(declared, a, b):
    """Two sets of values combined name by name."""
    return {name: side.combine(a[name], b[name]) for name, side in declared.items()}


def over_axis(declared, values, axis):
    """Values combined over a mesh axis (SideValue.over)."""
    return {name: side.over(values[name], axis) for name, side in declared.items()}


def where_ran(declared, ran, values):
    """values where `ran` (a traced bool), the identities elsewhere: a bubble's are dropped
    by selection, never by a multiplication (a NaN it holds stays out)."""
    return {name: jnp.where(ran, values[name], side.identity()) for name, side in declared.items()}


def detach(declared, values):
    """The values in fp32, those not differentiable cut from autodiff: a VJP sees no path
    from them to the parameters."""
    out = {}
    for name, side in declared.items():
        value = values[name].astype(jnp.float32)
        out[name] = value if side.differentiable else jax.lax.stop_gradient(value)
    return out


def objective(declared, loss, values):
    """What the engines differentiate: loss + the sum of every differentiable value (loss
    itself, the same traced value, when none is)."""
    return sum((values[n].sum() for n, s in declared.items() if s.differentiable), start=loss)


def cotangents(declared):
    """The values' cotangent in a chunk's VJP, the gradient of `objective` with respect to
    them: 1 for a differentiable value, 0 for the others."""
    return {
        name: jnp.full(side.shape, float(side.differentiable), jnp.float32)
        for name, side in declared.items()
    }


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
    values: Any = dataclasses.field(default_factory=dict)  # {name: SideValue} apply_blocks emits
    # prepare(chunk): what apply_blocks reads of a chunk's parameters beside them, made once a
    # step outside an engine's loop and handed to it as apply_blocks(..., prepared=): FP8's
    # quantized weights (model/fp8_sites.py); None: nothing (each call works from the chunk)
    prepare: Any = None
    offload: tuple = ()  # model.remat_offload: the names remat_policy keeps in host memory


def shared_params(params):
    """Every parameter outside the block stack (embeddings, final norm): each stage holds all."""
    return {k: v for k, v in params.items() if k != 'blocks'}
