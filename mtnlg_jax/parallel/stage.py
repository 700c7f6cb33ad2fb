"""One pipeline stage's work per tick of the 1F1B / interleaved table (pipeline.py runs it).

Built inside the engine's `shard_map` (manual over 'stage'), once per step: `Stage` holds this
stage's chunks, the shared parameters, every micro-batch's inputs and the residual layout
probed before the scan; `tick` is the body of the scan over the table's rows (branches.Columns,
this stage's row of them). Every stage runs the same program; `lax.cond` on each slot's kind
(branches.py) picks what it computes, so an idle slot costs nothing:

    arrivals -> stash[act_slot], grads[grad_slot]            (last tick's ppermute)
    forward  y, vjp = jax.vjp(chunk, stash[slot])   chunk 0: chunk(embed(tokens))
             resids[resid_slot] = vjp's residuals   last chunk: nothing (see backward)
    backward vjp = from resids[resid_slot]          cotangent grads[grad_slot]
             last chunk: y, vjp = jax.vjp(chunk, stash[slot]), then final norm, head, loss;
             the loss's gradient is the cotangent
             fp32 accumulators += parameter gradients;   dx = gradient of the stage input
             (the conditionals return gradients; the accumulators are updated after them, in
             place: a conditional that hands a buffer through has XLA copy it in its branches)
    y -> stage s + 1, dx -> stage s - 1 (rings), split over 'tensor' along the sequence

The carry of the scan: (act_in, grad_in, stash, resids, grad_buf, sums), sums = (fp32 block
accumulators (v, L / (p v), ...), fp32 shared accumulators, loss).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel.branches import (
    BACKWARD,
    EVAL,
    FIRST,
    FORWARD,
    LAST,
    SLOT_FIRST,
    SLOT_IDLE,
    SLOT_LAST,
)
from mtnlg_jax.parallel.residuals import join_vjp, split_vjp
from mtnlg_jax.parallel.rules import constrain

STAGE_AXIS = 'stage'
ACTIVATION_AXES = ('batch', 'residual_seq', 'embed')  # gathered, unless sequence parallel


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stage's work: fns (stage_functions.StageFunctions), chunks (this stage's blocks,
    (v, L / (p v), ...)), shared (the parameters every stage holds), batch (MicroBatch of all
    micro-batches), index (this stage, traced), stages, per_chunk (layers a chunk), fill
    (what idle outputs hold, (rows, seq, hidden)), layout (the residuals' layout,
    residuals.split_vjp's; None without gradients), handoff_axes (a hand-off's split)."""

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

    @property
    def with_grads(self):
        return self.layout is not None

    def chunk_at(self, repeat):
        return jax.tree.map(lambda a: a[repeat], self.chunks)

    def apply(self, chunk, h, micro, repeat):
        """The chunk's blocks over h, gathered over 'tensor' on arrival."""
        h = constrain(h, ACTIVATION_AXES)
        first_layer, used = self.chunk_layers(repeat)
        batch = self.batch.at(micro)
        return self.fns.apply_blocks(chunk, h, batch, first_layer, self.fns.remat, used=used)

    def chunk_layers(self, repeat):
        """(model index of the chunk's first layer, its layers or None: every slot)."""
        layers = self.stage_layers
        if layers is None or not layers.padded:
            return (repeat * self.stages + self.index) * self.per_chunk, None
        firsts, sizes = (jnp.asarray(a, jnp.int32) for a in layers.tables())
        return firsts[repeat, self.index], sizes[repeat, self.index]

    def token_loss(self, shared, h, micro):
        return self.fns.head_loss_sum(shared, h, self.batch.at(micro))

    def input(self, kind, shared, h, micro):
        """Chunk 0's input is the embedding (recomputed, never stashed), others' the stashed
        hand-off, gathered over 'tensor'."""
        with jax.named_scope(FIRST):
            return jax.lax.cond(  # both branches laid out alike: XLA insists
                kind == SLOT_FIRST,
                lambda: constrain(self.fns.embed(shared, self.batch.at(micro)), ACTIVATION_AXES),
                lambda: constrain(h, ACTIVATION_AXES),
            )

    def chunk_fn(self, kind, micro, repeat):
        """The chunk as a function of its parameters, the shared ones (the embedding's, for
        chunk 0) and its stashed input: what a forward differentiates."""

        def run(params, x):
            chunk, shared = params
            return self.apply(chunk, self.input(kind, shared, x, micro), micro, repeat)

        return run

    def forward_with_residuals(self, kind, x, micro, repeat):
        """(y, what the chunk's backward needs under fns.remat, its layout): the VJP's
        residuals without the parameters (residuals.split_vjp), kept instead of recomputed."""
        params = (self.chunk_at(repeat), self.shared)
        return split_vjp(self.chunk_fn(kind, micro, repeat), params, x)

    def forward(self, fwd, stash, resids):
        """One chunk's forward (branches.Forward): y to the next stage, its residuals into
        resids[fwd.resid_slot]."""

        def run():
            x = stash[fwd.slot]
            if not self.with_grads:
                params = (self.chunk_at(fwd.repeat), self.shared)
                return self.chunk_fn(fwd.kind, fwd.micro, fwd.repeat)(params, x), []
            y, kept, layout = self.forward_with_residuals(fwd.kind, x, fwd.micro, fwd.repeat)
            # the same program as the probe's: the same parameters in the same places
            assert layout[1] == self.layout[1], 'a forward kept another layout'
            return y, kept

        def idle():
            return self.fill, [jnp.zeros(b.shape[1:], b.dtype) for b in resids]

        with jax.named_scope(FORWARD):
            y, kept = jax.lax.cond(fwd.kind == SLOT_IDLE, idle, run)
        ran = (fwd.kind != SLOT_IDLE) & (fwd.kind != SLOT_LAST)
        return y, [write(b, fwd.resid_slot, ran, r) for b, r in zip(resids, kept)]

    def backward(self, bwd, sums, stash, resids, grad_buf):
        """One chunk's backward (branches.Backward) through the VJP its forward kept; the last
        chunk runs its forward here, then final norm, head and loss, whose gradient starts the
        VJP. Without gradients: the last chunk's loss only."""
        h, g = stash[bwd.slot], grad_buf[bwd.grad_slot]
        # the slot's residuals, read here: a conditional handed the whole buffers would copy
        # them (XLA:CPU does), a slice is what the branch needs
        kept = [jax.lax.dynamic_index_in_dim(b, bwd.resid_slot, 0, False) for b in resids]
        if not self.with_grads:
            with jax.named_scope(EVAL), jax.named_scope(LAST):
                return jax.lax.cond(
                    bwd.kind == SLOT_LAST,
                    lambda: self.loss_only(bwd, sums, h),
                    lambda: (sums, self.fill),
                )
        # The conditional returns this tick's gradients, never the accumulators: handed
        # through one, XLA:GPU copies every fp32 accumulator in both branches, every tick.
        acc_blocks, acc_shared, loss = sums
        with jax.named_scope(BACKWARD):
            d_chunk, d_shared, value, dx = jax.lax.cond(
                bwd.kind == SLOT_IDLE,
                self.no_gradients,
                lambda: self.pull_back(bwd, h, g, kept),
            )
        acc_blocks = add_chunk(acc_blocks, bwd.repeat, d_chunk)
        return (acc_blocks, add(acc_shared, d_shared), loss + value), dx

    def no_gradients(self):
        """An idle backward's: zero gradients, no loss, the fill as the input's gradient."""
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        d_chunk = zeros(self.chunk_at(0))
        return d_chunk, zeros32(self.shared), jnp.zeros((), jnp.float32), self.fill

    def loss_only(self, bwd, sums, h):
        """The last chunk's loss added to sums (evaluation)."""
        acc_blocks, acc_shared, loss = sums
        x = self.apply(
            self.chunk_at(bwd.repeat), constrain(h, ACTIVATION_AXES), bwd.micro, bwd.repeat
        )
        return (
            acc_blocks,
            acc_shared,
            loss + self.token_loss(self.shared, x, bwd.micro),
        ), self.fill

    def pull_back(self, bwd, h, g, kept_earlier):
        """(the chunk's gradients, the shared parameters' in fp32, the loss (0 but for the
        last chunk), the stage input's gradient). Each branch applies its own VJP: a branch
        that handed the stashed residuals through would have XLA copy them in both."""
        params = (self.chunk_at(bwd.repeat), self.shared)

        def pullback(kept, d_y, d_head):
            # d_shared: the embedding's half of the tied gradient (zeros but for chunk 0)
            (d_chunk, d_shared), d_h = join_vjp(self.layout, kept, params)(d_y)
            return d_chunk, add(d_head, d_shared), d_h

        def head():  # the last chunk: its forward, the loss and the loss's gradient
            y, kept, _ = self.forward_with_residuals(bwd.kind, h, bwd.micro, bwd.repeat)
            value, (d_shared, d_y) = jax.value_and_grad(self.token_loss, argnums=(0, 1))(
                self.shared, y, bwd.micro
            )
            d_head = add(zeros32(self.shared), d_shared)
            d_chunk, d_shared, d_h = pullback(kept, d_y.astype(y.dtype), d_head)
            return d_chunk, d_shared, value, d_h

        def stashed():  # the forward ran in an earlier tick: its residuals, the gradient
            d_y = constrain(g, ACTIVATION_AXES)
            d_chunk, d_shared, d_h = pullback(kept_earlier, d_y, zeros32(self.shared))
            return d_chunk, d_shared, jnp.zeros((), jnp.float32), d_h

        with jax.named_scope(LAST):
            return jax.lax.cond(bwd.kind == SLOT_LAST, head, stashed)

    def handoff(self, x, ring):
        return jax.lax.ppermute(constrain(x, self.handoff_axes), STAGE_AXIS, ring)

    def tick(self, carry, columns):
        """The scan's body: one tick of the table (branches.Columns, every stage's row)."""
        act_in, grad_in, stash, resids, grad_buf, sums = carry
        row = jax.tree.map(lambda a: a[self.index], columns)
        arrivals = row.arrivals
        stash = write(stash, arrivals.act_slot, arrivals.act, act_in)
        grad_buf = write(grad_buf, arrivals.grad_slot, arrivals.grad, grad_in)
        y, resids = self.forward(row.forward, stash, resids)
        sums, dx = self.backward(row.backward, sums, stash, resids, grad_buf)
        p = self.stages
        act_in = self.handoff(y, [(i, (i + 1) % p) for i in range(p)])
        grad_in = self.handoff(dx, [(i, (i - 1) % p) for i in range(p)])
        return (act_in, grad_in, stash, resids, grad_buf, sums), None


def write(buffer, slot, arrived, value):
    """buffer[slot] = value where `arrived`, else as it was."""
    kept = jnp.where(arrived, value, jax.lax.dynamic_index_in_dim(buffer, slot, 0, False))
    return jax.lax.dynamic_update_index_in_dim(buffer, kept, slot, 0)


def zeros32(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def add(acc, grads):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def add_chunk(acc, repeat, grads):
    """acc[repeat] += grads as a scatter-add: XLA:GPU updates the slot in one in-place pass
    (a dynamic slice, an add and a dynamic update slice read and write it three times)."""
    return jax.tree.map(lambda a, g: a.at[repeat].add(g.astype(a.dtype)), acc, grads)
