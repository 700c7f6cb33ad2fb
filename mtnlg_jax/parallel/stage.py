"""A pipeline stage and one chunk's work on it, whichever tick of the 1F1B / interleaved engine
(pipeline.py) runs it: the tick by slot (tick_by_slot.py, which draws the tick), the steady
tick (steady_tick.py) or the reducing one (reducing_tick.py), their backward slots through
backward_slot.py.

Built inside the engine's `shard_map` (manual over 'stage'), once per step: `Stage` holds this
stage's chunks, the shared parameters, every micro-batch's inputs and the residual layout
probed before the scan. Its methods are a chunk's work: the chunk as a function of its
parameters (chunk 0's input the embedding, recomputed, never stashed), its forward with the
VJP's residuals kept (residuals.split_vjp), the gradients through the VJP they rebuild (the
last chunk's: its forward, final norm, head and loss first), an idle slot's zeros and fill,
the evaluation's loss, the shared accumulators' add. `on_chunk` runs a slot's chunk, traced,
as a `lax.switch` over the chunks whose branch k reads chunk k's weights where they lie.

Chunks are separate trees, not one stacked (v, ...) array: slicing a chunk's weights and
accumulators out of a stack by a traced index copies them every tick (XLA:GPU does not read a
dynamic slice in place in a GEMM).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel.branches import ACCUMULATE_SHARED, CHUNK, FIRST, LAST, SLOT_FIRST, SLOT_LAST
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel import stage_order, taps
from mtnlg_jax.parallel.residuals import join_vjp, split_vjp
from mtnlg_jax.parallel.slots import add_unless, zeros
from mtnlg_jax.parallel.rules import constrain

ACTIVATION_AXES = ('batch', 'residual_seq', 'embed')  # gathered, unless sequence parallel


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stage's work: fns (stage_functions.StageFunctions), chunks (this stage's v chunks, a
    tuple of block trees (L / (p v), ...)), shared (the parameters every stage holds), batch
    (MicroBatch of all micro-batches), index (this stage, traced), stages, per_chunk (layers
    a chunk), fill (what idle outputs hold, (rows, seq, hidden)), layout (the residuals'
    layout, residuals.split_vjp's; None without gradients), handoff_axes (a hand-off's
    split)."""

    fns: Any
    chunks: Any
    shared: Any
    batch: Any
    index: Any
    stages: int
    per_chunk: int
    fill: Any
    layout: Any
    handoff_axes: tuple
    stage_layers: Any = None  # stage_order.StageLayers of unequal stages (None: equal)
    split: bool = False  # the table splits the backward into B and W (zero_bubble.py)
    v_shape: bool = False  # two chunks a stage in a V (zero_bubble_v.py, stage_order.py)
    sites: Any = None  # with gradients: a layer's tapped matmuls (taps.probe's Sites)
    # not split, with gradients: each backward's kernel gradients contracted in fp32 from its
    # taps inside the accumulators' add, which XLA:GPU then fuses into the GEMM (cuBLAS or
    # Triton's epilogue, as Megatron's gradient_accumulation_fusion) instead of an fp32 add
    # of the kernel's size each backward
    fused: bool = False
    pairs: Any = None  # the steady tick's keys (branches.steady_pairs; None: the tick by slot)
    unroll: bool = False  # the steady tick: the chunk's layers unrolled (pipeline.run_table)
    prepared: Any = None  # fns.prepare of each chunk, made once a step (None: no prepare)
    # pipeline.overlap_grad_reduce: (grad_reduce.Plan, the block leaves' zero.ShardLayouts)
    reduce: Any = None
    # with gradients: where the kept residuals wait (offload.Slots: on the device or the host)
    residual_slots: Any = None

    def with_chunks(self, chunks):
        """This stage on `chunks` (fns.prepare made of each once)."""
        prepared = None if self.fns.prepare is None else tuple(map(self.fns.prepare, chunks))
        return dataclasses.replace(self, chunks=chunks, prepared=prepared)

    @property
    def with_grads(self):
        return self.layout is not None

    def on_chunk(self, repeat, fn):
        """fn(chunk, k) for this stage's chunk k = repeat (traced): a switch over the chunks
        whose branch k reads chunk k's parameters where they lie (the module docstring)."""
        if len(self.chunks) == 1:
            return fn(self.chunks[0], 0)
        branches = [functools.partial(fn, chunk, k) for k, chunk in enumerate(self.chunks)]
        with jax.named_scope(CHUNK):
            return jax.lax.switch(repeat, branches)

    def apply(self, chunk, h, micro, repeat, *tapped, prepared=None, offload=False):
        """(the chunk's blocks over h, gathered over 'tensor' on arrival, their side values:
        fp32, those not differentiable cut from autodiff); tapped: (the blocks' taps,) of a
        split backward (taps.py), else (); prepared: fns.prepare's of the chunk, or None."""
        h = constrain(h, ACTIVATION_AXES)
        first_layer, used = self.chunk_layers(repeat)
        batch = self.batch.at(micro)
        more = {'taps': tapped[0]} if tapped else {}
        if self.unroll:
            more['unroll'] = True
        if prepared is not None:
            more['prepared'] = prepared
        if self.fns.offload:  # False: the engine moves them itself (offload.py)
            more['offload'] = offload
        y, values = self.fns.apply_blocks(
            chunk, h, batch, first_layer, self.fns.remat, used=used, **more
        )
        return y, side.detach(self.fns.values, values)

    def chunk_layers(self, repeat):
        """(model index of the chunk's first layer, its layers or None: every slot)."""
        layers = self.stage_layers
        if layers is None or not layers.padded:
            chunk = stage_order.chunk_index(repeat, self.index, self.stages, self.v_shape)
            return chunk * self.per_chunk, None
        firsts, sizes = (jnp.asarray(a, jnp.int32) for a in layers.tables())
        return firsts[repeat, self.index], sizes[repeat, self.index]

    def token_loss(self, shared, h, micro):
        return self.fns.head_loss_sum(shared, h, self.batch.at(micro))

    def input(self, kind, shared, h, micro):
        """Chunk 0's input is the embedding (recomputed, never stashed), others' the stashed
        hand-off, gathered over 'tensor'."""

        def first():
            x = constrain(self.fns.embed(shared, self.batch.at(micro)), ACTIVATION_AXES)
            if self.split or self.fused:  # h's gradient, zero here, as the other branch's: B
                # hands it off (unused), and XLA insists on one layout (sequence parallel)
                x = jnp.where(kind == SLOT_FIRST, x, constrain(h, ACTIVATION_AXES))
            return x

        with jax.named_scope(FIRST):
            return jax.lax.cond(  # both branches laid out alike: XLA insists
                kind == SLOT_FIRST, first, lambda: constrain(h, ACTIVATION_AXES)
            )

    def chunk_fn(self, kind, micro, repeat, offload=False):
        """The chunk as a function of its parameters (params_of), the shared ones (the
        embedding's, for chunk 0) and its stashed input, returning (output, side values): what
        a forward differentiates."""

        def run(params, x, *tapped):
            chunk, shared, prepared = params
            h = self.input(kind, shared, x, micro)
            return self.apply(chunk, h, micro, repeat, *tapped, prepared=prepared, offload=offload)

        return run

    def params_of(self, chunk, k):
        """(chunk k's parameters, the shared ones, what fns.prepare made of the chunk once a
        step or None): what its VJP takes as parameters, so none is among the residuals a
        forward stashes (residuals.split_vjp); the prepared part gets no gradient."""
        return chunk, self.shared, None if self.prepared is None else self.prepared[k]

    def forward_with_residuals(self, chunk, kind, x, micro, repeat, offload=False):
        """((y, side values), what the chunk's backward needs under fns.remat, its layout):
        the VJP's residuals without the parameters (residuals.split_vjp), kept instead of
        recomputed; a split backward's VJP also of the chunk's zero taps (taps.py). offload:
        model.remat_offload's names moved to the host by the policy (offload.hosted's
        probe), not kept on the device for the engine to move."""
        tapped = () if self.sites is None else (taps.zeros(self.sites, self.per_chunk),)
        params = self.params_of(chunk, repeat)
        with taps.handed_out_as_read(self.fused):  # fused: gathered in B, beside its GEMMs
            return split_vjp(self.chunk_fn(kind, micro, repeat, offload), params, x, *tapped)

    def forward_chunk(self, chunk, repeat, fwd, x):
        """((y, side values), the residuals its backward needs: [] without gradients) of
        chunk `repeat` (static) over its stashed input x."""
        if not self.with_grads:
            params = self.params_of(chunk, repeat)
            return self.chunk_fn(fwd.kind, fwd.micro, repeat)(params, x), []
        out, kept, layout = self.forward_with_residuals(chunk, fwd.kind, x, fwd.micro, repeat)
        # the same program as the probe's: the same parameters in the same places
        assert layout[1] == self.layout[1], 'a forward kept another layout'
        return out, kept

    def idle_forward(self):
        """An idle forward's ((the fill, the identities), zero residuals)."""
        no_values = side.identities(self.fns.values)
        return (self.fill, no_values), self.residual_slots.zeros()

    def without_taps(self, grads):
        """pull_back's tuple with None at the tapped kernels (split: W computes those), so a
        conditional hands out no zeros of their size; as it was unless split."""
        d_chunk, *rest = grads
        return (d_chunk if self.sites is None else taps.untapped(d_chunk, self.sites)), *rest

    def add_shared(self, bwd, acc_shared, d_shared):
        """The shared accumulators + d_shared, in place, where the slot touched them: only
        chunk 0 (the embedding) and the last chunk (final norm, head) do."""
        untouched = (bwd.kind != SLOT_FIRST) & (bwd.kind != SLOT_LAST)
        with jax.named_scope(ACCUMULATE_SHARED):
            return add_unless(untouched, acc_shared, d_shared)

    def no_gradients(self):
        """An idle backward's: zero gradients, no loss, no side values (the identities), the
        fill as the input's gradient, zero taps (none unless split)."""
        d_chunk, d_shared = zeros(self.chunks[0]), zeros(self.shared)
        no_values = side.identities(self.fns.values)
        tapped = [] if self.sites is None else taps.zeros(self.sites, self.per_chunk)
        return d_chunk, d_shared, jnp.zeros((), jnp.float32), no_values, self.fill, tapped

    def combine(self, acc_values, values):
        """The side values' accumulators combined with a slot's (the identities where it ran
        nothing)."""
        return side.combine(self.fns.values, acc_values, values)

    def loss_only(self, bwd, sums, h):
        """The last chunk's loss and side values added to sums (evaluation)."""
        acc_blocks, acc_shared, loss, acc_values = sums

        def last_chunk(chunk, repeat):
            prepared = self.params_of(chunk, repeat)[2]
            h_in = constrain(h, ACTIVATION_AXES)
            x, values = self.apply(chunk, h_in, bwd.micro, repeat, prepared=prepared)
            return self.token_loss(self.shared, x, bwd.micro), values

        value, values = self.on_chunk(bwd.repeat, last_chunk)
        return (acc_blocks, acc_shared, loss + value, self.combine(acc_values, values)), self.fill

    def pull_back(self, bwd, h, g, kept_earlier):
        """(the chunk's gradients, the shared parameters', the loss (0 but for the last
        chunk), the last chunk's side values (the identities but for it: a forward slot
        accumulated the others'), the stage input's gradient, the chunk's taps: [] unless
        split), gradients in the compute dtype (the accumulators take them in fp32); split,
        the tapped kernels' gradients are zero (their taps hold what W needs). The VJP's
        cotangent of the side values is 1 for a differentiable one, 0 for the others
        (stage_functions.objective). Each branch applies its own VJP: a branch that handed
        the stashed residuals through would have XLA copy them in both."""
        return self.on_chunk(
            bwd.repeat, functools.partial(self.chunk_gradients, bwd, h, g, kept_earlier)
        )

    def chunk_gradients(self, bwd, h, g, kept, chunk, repeat):
        """pull_back's tuple of chunk `repeat` (static): the head's path or the stashed one."""
        d_values = side.cotangents(self.fns.values)

        def head():
            return self.head_gradients(chunk, repeat, bwd, h, d_values)

        def stashed():
            return self.stashed_gradients(chunk, repeat, g, kept, d_values)

        with jax.named_scope(LAST):
            return jax.lax.cond(bwd.kind == SLOT_LAST, head, stashed)

    def head_gradients(self, chunk, repeat, bwd, h, d_values):
        """pull_back's tuple for the last chunk (repeat static): its forward over its stashed
        input h, the loss and the loss's gradient, back through the chunk."""
        (y, values), kept, _ = self.forward_with_residuals(chunk, bwd.kind, h, bwd.micro, repeat)
        value, (d_shared, d_y) = jax.value_and_grad(self.token_loss, argnums=(0, 1))(
            self.shared, y, bwd.micro
        )
        d_chunk, d_shared, d_h, tapped = self.pullback(
            chunk, repeat, kept, d_y.astype(y.dtype), d_shared, d_values
        )
        return d_chunk, d_shared, value, values, d_h, tapped

    def stashed_gradients(self, chunk, repeat, g, kept, d_values):
        """pull_back's tuple for a chunk whose forward ran in an earlier tick: its residuals
        kept, g its output's gradient."""
        d_y = constrain(g, ACTIVATION_AXES)
        d_chunk, d_shared, d_h, tapped = self.pullback(
            chunk, repeat, kept, d_y, zeros(self.shared), d_values
        )
        no_values = side.identities(self.fns.values)
        return d_chunk, d_shared, jnp.zeros((), jnp.float32), no_values, d_h, tapped

    def pullback(self, chunk, repeat, kept, d_y, d_head, d_values):
        """(d_chunk, d_shared, d_h, taps) through the VJP the residuals `kept` rebuild.
        d_shared: the embedding's half of the tied gradient (zeros but for chunk 0) plus
        d_head; exact in the compute dtype: chunk 0 and the last are on different stages (in
        the V different slots of stage 0), so one of d_head and d_shared is zero."""
        pullback = join_vjp(self.layout, kept, self.params_of(chunk, repeat))
        (d_chunk, d_shared, _), d_h, *tapped = pullback((d_y, d_values))
        d_shared = jax.tree.map(jnp.add, d_head, d_shared)
        return d_chunk, d_shared, d_h, tapped[0] if tapped else []
