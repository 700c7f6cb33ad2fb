"""One pipeline stage's work per tick of the 1F1B / interleaved table (pipeline.py runs it).

Built inside the engine's `shard_map` (manual over 'stage'), once per step: `Stage` holds this
stage's chunks, the shared parameters, every micro-batch's inputs and the residual layout
probed before the scan; `tick` is the body of the scan over the table's rows (branches.Columns,
this stage's row of them). Every stage runs the same program; `lax.cond` on each slot's kind
(branches.py) picks what it computes, so an idle slot costs nothing, and (interleaved) a
`lax.switch` on the slot's chunk runs it on that chunk's weights where they lie:

    arrivals -> stash[act_slot], grads[grad_slot]            (last tick's ppermute)
    forward  (y, vals), vjp = jax.vjp(chunk, stash[slot])   chunk 0: chunk(embed(tokens))
             resids[resid_slot] = vjp's residuals   last chunk: nothing (see backward)
             side values += vals (the identities where idle)
    backward vjp = from resids[resid_slot]          cotangent (grads[grad_slot], 1 for a
                                                    differentiable side value, else 0)
             last chunk: (y, vals), vjp = jax.vjp(chunk, stash[slot]), then final norm,
             head, loss; the loss's gradient is the cotangent; side values += vals
             fp32 accumulators += parameter gradients;   dx = gradient of the stage input
             (the conditionals return gradients; each chunk's accumulators, and the shared
             ones, are updated after them, in place, by a conditional that skips them unless
             the slot ran that chunk: a conditional that hands a buffer through its false
             branch has XLA:GPU copy it, through its true branch not); under
             pipeline.fused_accumulation the kernels' gradients leave the VJP as their taps
             (taps.py: x, dy, gathered in B), contracted in fp32 in that add: the dW
             GEMM's epilogue (Stage.fused); several chunks, by slot: a conditional a chunk
             (chained.py), its dW GEMMs in its backward's computation but QKV's
    y -> stage s + 1, dx -> stage s - 1 (rings), split over 'tensor' along the sequence;
    in the V (zero_bubble_v.py) both also the other way, the turn on stage p - 1 local

A split backward (zero_bubble.py) runs B in the backward slot, the backward but for the
kernels' weight gradients, whose taps (parallel/taps.py) go into tap_bufs[b_tap_slot], and W
in a slot of its own: dW = x^T dy from tap_bufs[tap_slot], added to the accumulators.

The steady tick (pipeline.steady_tick, `steady_tick`): one `lax.switch` per tick over the
(forward chunk, backward chunk, last chunk's backward) pairs the table holds
(branches.steady_pairs), each branch running both slots' layer work, unrolled, in one
computation, with no conditional around either: XLA's scheduler orders a computation on its
own, so a forward's tensor collectives can then hide under the other micro-batch's backward
matmuls. Idle slots are branches of their own; chunk 0's embedding stays a cond inside. The
hand-offs and W are the tick by slot's (the V's both ways included).

The carry of the scan: (act_in, grad_in (in the V pairs, each way's), stash, resids,
grad_buf, tap_bufs ([] unless split; fused, several chunks, by slot: chained.scratch),
sums), sums = (fp32 block accumulators, one tree (L / (p v), ...) a chunk, fp32 shared
accumulators, loss, side values: {name: fp32 array}, empty when the model declares none).
Chunks are separate trees, not one stacked (v, ...) array: slicing a chunk's weights and
accumulators out of a stack by a traced index copies them every tick (XLA:GPU does not read a
dynamic slice in place in a GEMM).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel.branches import (
    ACCUMULATE,
    ACCUMULATE_SHARED,
    BACKWARD,
    BACKWARD_INPUT,
    CHUNK,
    EVAL,
    FIRST,
    FORWARD,
    LAST,
    REDUCE,
    SLOT_FIRST,
    SLOT_IDLE,
    SLOT_LAST,
    STEADY,
    WEIGHTS,
)
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel import chained, grad_reduce, stage_order, taps
from mtnlg_jax.parallel.residuals import join_vjp, split_vjp
from mtnlg_jax.parallel.slots import add, add_unless, read, write, zeros
from mtnlg_jax.parallel.rules import STAGE_AXIS, constrain

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

    def apply(self, chunk, h, micro, repeat, *tapped, prepared=None):
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

    def chunk_fn(self, kind, micro, repeat):
        """The chunk as a function of its parameters (params_of), the shared ones (the
        embedding's, for chunk 0) and its stashed input, returning (output, side values): what
        a forward differentiates."""

        def run(params, x, *tapped):
            chunk, shared, prepared = params
            h = self.input(kind, shared, x, micro)
            return self.apply(chunk, h, micro, repeat, *tapped, prepared=prepared)

        return run

    def params_of(self, chunk, k):
        """(chunk k's parameters, the shared ones, what fns.prepare made of the chunk once a
        step or None): what its VJP takes as parameters, so none is among the residuals a
        forward stashes (residuals.split_vjp); the prepared part gets no gradient."""
        return chunk, self.shared, None if self.prepared is None else self.prepared[k]

    def forward_with_residuals(self, chunk, kind, x, micro, repeat):
        """((y, side values), what the chunk's backward needs under fns.remat, its layout):
        the VJP's residuals without the parameters (residuals.split_vjp), kept instead of
        recomputed; a split backward's VJP also of the chunk's zero taps (taps.py)."""
        tapped = () if self.sites is None else (taps.zeros(self.sites, self.per_chunk),)
        params = self.params_of(chunk, repeat)
        with taps.handed_out_as_read(self.fused):  # fused: gathered in B, beside its GEMMs
            return split_vjp(self.chunk_fn(kind, micro, repeat), params, x, *tapped)

    def forward(self, fwd, stash, resids):
        """One chunk's forward (branches.Forward): (y to the next stage, resids with its
        residuals in resids[fwd.resid_slot], its side values: the identities where the slot
        is idle, as the last chunk's is: its backward slot runs it)."""

        def run_chunk(chunk, repeat):
            return self.forward_chunk(chunk, repeat, fwd, stash[fwd.slot])

        def run():
            return self.on_chunk(fwd.repeat, run_chunk)

        with jax.named_scope(FORWARD):
            (y, values), kept = jax.lax.cond(
                fwd.kind == SLOT_IDLE, lambda: self.idle_forward(resids), run
            )
        ran = (fwd.kind != SLOT_IDLE) & (fwd.kind != SLOT_LAST)
        return y, [write(b, fwd.resid_slot, ran, r) for b, r in zip(resids, kept)], values

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

    def idle_forward(self, resids):
        """An idle forward's ((the fill, the identities), zero residuals)."""
        no_values = side.identities(self.fns.values)
        return (self.fill, no_values), [jnp.zeros(b.shape[1:], b.dtype) for b in resids]

    def backward(self, bwd, sums, stash, resids, grad_buf, tap_bufs):
        """One chunk's backward (branches.Backward) through the VJP its forward kept; the last
        chunk runs its forward here, then final norm, head and loss, whose gradient starts the
        VJP. Without gradients: the last chunk's loss only. Returns (sums, dx, tap_bufs)."""
        h, g, kept = self.slot_inputs(bwd, stash, resids, grad_buf)
        if not self.with_grads:
            with jax.named_scope(EVAL), jax.named_scope(LAST):
                return *jax.lax.cond(
                    bwd.kind == SLOT_LAST,
                    lambda: self.loss_only(bwd, sums, h),
                    lambda: (sums, self.fill),
                ), tap_bufs
        if len(self.chunks) == 1:
            return *self.backward_one_chunk(bwd, sums, h, g, kept)[:2], tap_bufs
        if self.fused:  # a conditional a chunk, its dW GEMMs beside its backward's
            return chained.backward(self, bwd, sums, h, g, kept, tap_bufs)
        return self.backward_chunks(bwd, sums, h, g, kept)

    def backward_chunks(self, bwd, sums, h, g, kept, scope=BACKWARD):
        """Several chunks a stage: the conditional returns this tick's gradients, never the
        accumulators (handed through one, XLA:GPU copies every fp32 accumulator in both
        branches, every tick); each chunk's are added to after it, where the slot ran that
        chunk. Split, the tapped kernels' gradients are W's: left out. Returns (sums, the
        input's gradient, the taps: [] unless split)."""
        with jax.named_scope(scope):
            grads = jax.lax.cond(
                bwd.kind == SLOT_IDLE,
                lambda: self.without_taps(self.no_gradients()),
                lambda: self.without_taps(self.pull_back(bwd, h, g, kept)),
            )
        return self.add_gradients(bwd, sums, grads)

    def without_taps(self, grads):
        """pull_back's tuple with None at the tapped kernels (split: W computes those), so a
        conditional hands out no zeros of their size; as it was unless split."""
        d_chunk, *rest = grads
        return (d_chunk if self.sites is None else taps.untapped(d_chunk, self.sites)), *rest

    def add_gradients(self, bwd, sums, grads):
        """(sums + a backward slot's gradients (pull_back's tuple), the input's gradient, its
        taps): each chunk's accumulators in place unless the slot ran another (split: all but
        the tapped kernels', W's)."""
        d_chunk, d_shared, value, values, dx, tapped = grads
        acc_blocks, acc_shared, loss, acc_values = sums
        idle = bwd.kind == SLOT_IDLE
        if self.fused:  # the taps as B gathered them: no accumulator's conditional holds a
            # collective (XLA:GPU then hides the hand-offs behind the dW GEMMs)
            d_chunk = (d_chunk, taps.hold(tapped, self.sites))
        with jax.named_scope(ACCUMULATE):
            acc_blocks = tuple(
                add_unless(idle | (bwd.repeat != k), acc, d_chunk, self.add_chunk)
                for k, acc in enumerate(acc_blocks)
            )
        acc_shared = self.add_shared(bwd, acc_shared, d_shared)
        sums = (acc_blocks, acc_shared, loss + value, self.combine(acc_values, values))
        return sums, dx, tapped

    def slot_inputs(self, bwd, stash, resids, grad_buf):
        """(the last chunk's stashed input, the output's gradient, the residuals) a backward
        slot reads: the slot's residuals read here, since a conditional handed the whole
        buffers would copy them (XLA:CPU does); a slice is what the branch needs."""
        kept = [jax.lax.dynamic_index_in_dim(b, bwd.resid_slot, 0, False) for b in resids]
        return stash[bwd.slot], grad_buf[bwd.grad_slot], kept

    def backward_input(self, bwd, slot, sums, stash, resids, grad_buf, tap_bufs):
        """A split backward's B (one chunk a stage): the whole backward through the VJP its
        forward kept, but for the tapped kernels' gradients: every other gradient added to
        sums, the chunk's taps (each kernel matmul's x and dy, taps.py) written into
        tap_bufs[slot] for W. Returns (sums, the input's gradient, tap_bufs)."""
        h, g, kept = self.slot_inputs(bwd, stash, resids, grad_buf)
        chunks = self.backward_one_chunk if len(self.chunks) == 1 else self.backward_chunks
        sums, dx, tapped = chunks(bwd, sums, h, g, kept, BACKWARD_INPUT)
        ran = bwd.kind != SLOT_IDLE
        tap_bufs = jax.tree.map(lambda b, t: write(b, slot, ran, t), tap_bufs, tapped)
        tap_bufs = taps.hold(tap_bufs, self.sites)  # a stream tap as its sequence shard
        return sums, dx, tap_bufs

    def weights(self, w, sums, tap_bufs):
        """A split backward's W (branches.Weights): the tapped kernels' gradients from the taps
        B stashed, dW = x^T dy per matmul (taps.add_weight_grads), added to the chunk's
        accumulators inside the conditional (its idle, true, branch hands them through)."""
        acc_blocks, *rest = sums
        # behind a barrier: without it XLA:GPU gave two tap buffers the dW matmuls' operand
        # layout and copied each every tick (tests/test_loop_copies.py)
        stashed = jax.tree.map(lambda b: read(b, w.tap_slot), tap_bufs)
        stashed = jax.lax.optimization_barrier(stashed)  # [(x, dy) or (dy,)] per site

        def run(acc):
            return taps.add_weight_grads(acc, self.sites, stashed)

        def skip(k):  # two chunks a stage (the V): where the slot ran another chunk too
            idle = w.kind == SLOT_IDLE
            return idle if len(acc_blocks) == 1 else idle | (w.repeat != k)

        with jax.named_scope(WEIGHTS):
            acc_blocks = tuple(
                jax.lax.cond(skip(k), lambda acc: acc, run, acc) for k, acc in enumerate(acc_blocks)
            )
        return (acc_blocks, *rest)

    def backward_one_chunk(self, bwd, sums, h, g, kept, scope=BACKWARD):
        """One chunk a stage: its accumulators are added to inside the backward's conditional,
        whose idle (true) branch hands them through, so an idle tick writes no zero gradient
        of the chunk's size. The shared accumulators stay outside it: added to in a nested
        conditional, XLA:GPU copies them in the outer one. Returns (sums, the input's
        gradient, the taps: [] unless split)."""
        acc_blocks, acc_shared, loss, acc_values = sums

        def idle(acc):
            *rest, tapped = self.no_gradients()[1:]
            return acc, *rest, [] if self.fused else tapped

        def run(acc):
            d_chunk, *rest, tapped = self.pull_back(bwd, h, g, kept)
            if self.fused:  # the taps used here, in B's branch
                return self.add_chunk(acc, (d_chunk, tapped)), *rest, []
            return self.add_chunk(acc, d_chunk), *rest, tapped

        with jax.named_scope(scope):
            acc, d_shared, value, values, dx, tapped = jax.lax.cond(
                bwd.kind == SLOT_IDLE, idle, run, acc_blocks[0]
            )
        acc_shared = self.add_shared(bwd, acc_shared, d_shared)
        return ((acc,), acc_shared, loss + value, self.combine(acc_values, values)), dx, tapped

    def add_chunk(self, acc, d_chunk):
        """A chunk's accumulators + its gradients (split: but the tapped kernels', W's;
        fused: d_chunk is (the gradients, the taps), the kernels' contracted here)."""
        if self.sites is None:
            return add(acc, d_chunk)
        if not self.fused:
            return taps.add_untapped(acc, d_chunk, self.sites)
        d_chunk, tapped = d_chunk
        acc = taps.add_untapped(acc, d_chunk, self.sites)
        return taps.add_weight_grads(acc, self.sites, tapped)

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

    def handoff(self, x, ring):
        return jax.lax.ppermute(constrain(x, self.handoff_axes), STAGE_AXIS, ring)

    def tick(self, carry, columns):
        """The scan's body: one tick of the table (branches.Columns, every stage's row; and
        the steady tick's pair index, (ticks, stages), where self.pairs is set)."""
        if self.pairs is not None:
            return self.steady_tick(carry, *columns)
        if self.reduce is not None:
            return self.reducing_tick(carry, *columns)
        act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums = carry
        row = jax.tree.map(lambda a: a[self.index], columns)
        stash, grad_buf = self.receive(row, act_in, grad_in, stash, grad_buf)
        y, resids, values = self.forward(row.forward, stash, resids)
        sums = (*sums[:3], self.combine(sums[3], values))  # the forward's side values
        if row.weights is None or not self.with_grads:
            sums, dx, tap_bufs = self.backward(
                row.backward, sums, stash, resids, grad_buf, tap_bufs
            )
        else:  # a split backward: B, then W (which may be another micro-batch's)
            slot = row.weights.b_tap_slot
            sums, dx, tap_bufs = self.backward_input(
                row.backward, slot, sums, stash, resids, grad_buf, tap_bufs
            )
            sums = self.weights(row.weights, sums, tap_bufs)
        act_in, grad_in = self.send(y, dx)
        return (act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums), None

    def reducing_tick(self, carry, columns, reduce_columns):
        """The tick by slot under pipeline.overlap_grad_reduce (grad_reduce.py): the backward's
        switch also picks the layer of a finished chunk its branch reduce-scatters, written
        into the carried shards."""
        act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums, shards = carry
        row = jax.tree.map(lambda a: a[self.index], columns)
        branch, chunk, layer = (a[self.index] for a in reduce_columns)
        stash, grad_buf = self.receive(row, act_in, grad_in, stash, grad_buf)
        y, resids, values = self.forward(row.forward, stash, resids)
        sums = (*sums[:3], self.combine(sums[3], values))
        bwd = row.backward
        h, g, kept = self.slot_inputs(bwd, stash, resids, grad_buf)
        idle = lambda: (self.without_taps(self.no_gradients()), grad_reduce.no_piece(shards))  # noqa: E731
        with jax.named_scope(BACKWARD):
            grads, piece = jax.lax.cond(
                bwd.kind == SLOT_IDLE,
                idle,
                lambda: self.reducing_pull_back(bwd, branch, h, g, kept, sums[0], shards),
            )
        sums, dx, _ = self.add_gradients(bwd, sums, grads)
        shards = grad_reduce.write_piece(shards, chunk, layer, piece)
        act_in, grad_in = self.send(y, dx)
        return (act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums, shards), None

    def reducing_pull_back(self, bwd, branch, h, g, kept, acc_blocks, shards):
        """(pull_back's tuple, one layer's shards) through a switch on `branch`: chunk k's
        backward (k < v), or a variant's (j, k, l): chunk j's from its stash beside the
        reduce-scatter of chunk k's layer l, in one computation."""
        plan, layouts = self.reduce
        d_values = side.cotangents(self.fns.values)

        def plain(k):
            grads = self.chunk_gradients(bwd, h, g, kept, self.chunks[k], k)
            return self.without_taps(grads), grad_reduce.no_piece(shards)

        def variant(j, k, n):
            grads = self.stashed_gradients(self.chunks[j], j, g, kept, d_values)
            return self.without_taps(grads), grad_reduce.reduce_layer(acc_blocks[k], n, layouts)

        branches = [functools.partial(plain, k) for k in range(len(self.chunks))]
        branches += [functools.partial(variant, *key) for key in plan.variants]
        with jax.named_scope(REDUCE):
            return jax.lax.switch(branch, branches)

    def receive(self, row, act_in, grad_in, stash, grad_buf):
        """Last tick's hand-offs into the slots the table gives them (in the V, act_in and
        grad_in are pairs: the way down's and the way back's)."""
        if row.back is None:
            ways = [(row.arrivals, act_in, grad_in)]
        else:
            ways = zip((row.arrivals, row.back), act_in, grad_in)
        for arrivals, act, grad in ways:
            stash = write(stash, arrivals.act_slot, arrivals.act, act)
            grad_buf = write(grad_buf, arrivals.grad_slot, arrivals.grad, grad)
        return stash, grad_buf

    def send(self, y, dx):
        """(act_in, grad_in) of the next tick: y to stage s + 1, dx to s - 1 (rings). In the
        V both go both ways: y down for the first chunk and back up for the second, dx the
        opposite; on stage p - 1 the way back starts with its own y and dx (the turn)."""
        p = self.stages
        if not self.v_shape:
            act_in = self.handoff(y, [(i, (i + 1) % p) for i in range(p)])
            grad_in = self.handoff(dx, [(i, (i - 1) % p) for i in range(p)])
            return act_in, grad_in
        down, up = [(i, i + 1) for i in range(p - 1)], [(i + 1, i) for i in range(p - 1)]
        turn = self.index == p - 1

        def turned(x):
            return jnp.where(turn, constrain(x, self.handoff_axes), self.handoff(x, up))

        return (self.handoff(y, down), turned(y)), (turned(dx), self.handoff(dx, down))

    def steady_tick(self, carry, columns, pairs):
        """The tick of pipeline.steady_tick (with gradients): one `lax.switch` over the pairs
        of (forward chunk, backward chunk, last chunk's backward) the table holds
        (branches.steady_pairs); a branch runs both slots' layer work in one computation,
        unconditionally, so the scheduler may hide the forward's tensor collectives under the
        backward's matmuls and back. Idle slots are branches of their own (the schedule's
        edges); the embedding's input stays a cond inside (Stage.input). What the slots
        return is written and added outside the switch, as the tick by slot does."""
        act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums = carry
        row = jax.tree.map(lambda a: a[self.index], columns)
        stash, grad_buf = self.receive(row, act_in, grad_in, stash, grad_buf)
        fwd, bwd = row.forward, row.backward
        x = read(stash, fwd.slot)
        h, g, kept = self.slot_inputs(bwd, stash, resids, grad_buf)
        branches = [
            functools.partial(self.pair, key, fwd, bwd, x, h, g, kept, resids) for key in self.pairs
        ]
        with jax.named_scope(STEADY):
            (y, values), kept_f, grads = jax.lax.switch(pairs[self.index], branches)
        ran = (fwd.kind != SLOT_IDLE) & (fwd.kind != SLOT_LAST)
        resids = [write(b, fwd.resid_slot, ran, r) for b, r in zip(resids, kept_f)]
        sums = (*sums[:3], self.combine(sums[3], values))  # the forward's side values
        sums, dx, tapped = self.add_gradients(bwd, sums, grads)
        if row.weights is not None:  # B wrote the taps; W (its own cond) reads them
            ran = bwd.kind != SLOT_IDLE
            slot = row.weights.b_tap_slot
            tap_bufs = jax.tree.map(lambda b, t: write(b, slot, ran, t), tap_bufs, tapped)
            sums = self.weights(row.weights, sums, tap_bufs)
        act_in, grad_in = self.send(y, dx)
        return (act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums), None

    def pair(self, key, fwd, bwd, x, h, g, kept, resids):
        """A steady branch: ((y, side values), the forward's residuals, pull_back's tuple) of
        key's forward (chunk f, -1: idle) and backward (chunk b, the head's when `last`)."""
        f, b, last = key
        out = self.idle_forward(resids) if f < 0 else self.forward_chunk(self.chunks[f], f, fwd, x)
        d_values = side.cotangents(self.fns.values)
        if b < 0:
            grads = self.no_gradients()
        elif not last:
            grads = self.stashed_gradients(self.chunks[b], b, g, kept, d_values)
        else:
            with jax.named_scope(LAST):
                grads = self.head_gradients(self.chunks[b], b, bwd, h, d_values)
        return (*out, self.without_taps(grads))
