"""The pipeline over the mesh axis 'stage': loss and explicit gradients, schedule-driven.

`loss_and_grads` is what the train step calls instead of `value_and_grad` when the mesh has
stages, with the model's pieces as functions (parallel/stage_functions.py: the engines import
nothing from the model). `pipeline.schedule`:
  1f1b / interleaved  a static table (parallel/schedule.py) says, for every tick and stage,
                      which forward and which backward to run; one `lax.scan` over the ticks
                      inside `jax.shard_map` manual over 'stage' runs it. Memory is flat in m.
  gpipe               autodiff of a forward scan (parallel/gpipe.py), kept for comparison.

One tick on one stage (every stage runs the same program; `lax.cond` on each slot's kind,
parallel/branches.py, picks what it computes, so an idle slot costs nothing):

    arrivals -> stash[recv_act_slot], grads[recv_grad_slot]        (last tick's ppermute)
    forward  y, vjp = jax.vjp(chunk, stash[fwd_slot])   chunk 0: chunk(embed(tokens))
             resids[fwd_resid_slot] = vjp's residuals   last chunk: nothing (see backward)
    backward vjp = from resids[bwd_resid_slot]          cotangent grads[bwd_grad_slot]
             last chunk: y, vjp = jax.vjp(chunk, stash[bwd_slot]), then final norm, head,
             loss; the loss's gradient is the cotangent
             fp32 accumulators += parameter gradients;   dx = gradient of the stage input
    y -> stage s + 1, dx -> stage s - 1 (rings), split over 'tensor' along the sequence

A forward keeps what its chunk's backward needs, the residuals of its VJP under
`model.remat` (every layer's kept values with remat none, the named matmul outputs with
selective, each layer's input with full), in a slot per micro-batch in flight; the backward
applies that VJP, so no chunk runs its forward twice and a pipelined step does the matmul
FLOPs of the same model unpipelined. The parameters inside a VJP are not stashed: the
backward puts the current chunk's back (parallel/residuals.py). The embedding runs on the first
stage, the final norm, head and loss on the last, one micro-batch a tick; only the loss is
summed over 'stage', and the gradients of the parameters outside the block stack (each stage
holds them all) are summed over 'stage': the tied embedding's two halves meet there, from the
first stage and the last.

Stored form: block parameters stage-major (parallel/stage_order.py), so the rule 'layers' ->
'stage' gives each stage exactly its own chunks.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mtnlg_jax.parallel import gpipe
from mtnlg_jax.parallel import schedule as schedule_lib
from mtnlg_jax.parallel.branches import (
    BACKWARD,
    EVAL,
    FIRST,
    FORWARD,
    LAST,
    SLOT_FIRST,
    SLOT_IDLE,
    SLOT_LAST,
    slot_kinds,
)
from mtnlg_jax.parallel.residuals import join_vjp, split_vjp
from mtnlg_jax.parallel.rules import constrain
from mtnlg_jax.parallel.stage_functions import shared_params

STAGE_AXIS = gpipe.STAGE_AXIS
SCHEDULES = ('gpipe', '1f1b', 'interleaved')
HANDOFF_AXES = ('batch', 'handoff_seq', 'embed')  # split over 'tensor' along the sequence
ACTIVATION_AXES = ('batch', 'residual_seq', 'embed')  # gathered, unless sequence parallel


def options(config):
    """The keywords of a config's pipeline: stages, repeats, schedule, max_in_flight."""
    return dict(
        stages=config.mesh.stage,
        repeats=config.pipeline.repeats,
        schedule=config.pipeline.schedule,
        max_in_flight=config.pipeline.get('max_in_flight', 0),
    )


def build_table(stages, repeats, micro_batches, max_in_flight=0):
    """The 1f1b / interleaved table (schedule.build; max_in_flight 0: no bound)."""
    return schedule_lib.build(stages, repeats, micro_batches, max_in_flight or None)


def num_ticks(stages, repeats, micro_batches, schedule='1f1b', max_in_flight=0):
    """Scan length: table ticks (1f1b / interleaved), iterations v m + p - 1 (gpipe)."""
    if schedule == 'gpipe':
        return gpipe.num_iterations(stages, repeats, micro_batches)
    return build_table(stages, repeats, micro_batches, max_in_flight).ticks


def bubble_fraction(stages, repeats, micro_batches, schedule='1f1b', max_in_flight=0):
    """Predicted share of the step the stages wait: from the table's ticks for 1f1b /
    interleaved (a backward costing 3 forwards, full recompute), (p - 1) / (v m + p - 1)
    for gpipe."""
    if stages == 1:
        return 0.0
    if schedule == 'gpipe':
        return gpipe.bubble_fraction(stages, repeats, micro_batches)
    return float(build_table(stages, repeats, micro_batches, max_in_flight).bubble_fraction())


def loss_and_grads(
    stage_fns,
    params,
    tokens,
    row_keys,
    *,
    stages,
    repeats,
    schedule='1f1b',
    max_in_flight=0,
    stage_layers=None,
):
    """(loss sum, token count, fp32 gradients shaped as params) of micro-batches tokens
    (m, rows, seq + 1), the block stack pipelined over 'stage'.

    stage_fns: the model's pieces (stage_functions.StageFunctions); params: its compute-dtype
    parameters (blocks stage-major); row_keys: one dropout key per sequence (m, rows), or
    None; stage_layers: stage_order.StageLayers (None: equal stages). Called by the train
    step inside its region manual over 'data' (one replica's rows); at top level with both
    'data' and 'tensor' larger than 1, XLA's SPMD partitioner aborts on the embedding's
    scatter-add."""
    if schedule == 'gpipe':
        # Differentiated in fp32 (the model casts each parameter to the compute dtype where
        # it uses it), so the scans' transposes sum every iteration's gradient in fp32.
        params = jax.tree.map(lambda p: p.astype(jnp.float32), params)

        def loss_sum(p):
            return gpipe.pipelined_loss_sum(
                stage_fns, p, tokens, row_keys, stages=stages, repeats=repeats
            )

        (loss, count), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
        return loss, count, grads
    ticks = build_table(stages, repeats, tokens.shape[0], max_in_flight)
    return run_schedule(
        stage_fns, params, tokens, row_keys, ticks, with_grads=True, stage_layers=stage_layers
    )


def loss_sum(
    stage_fns,
    params,
    tokens,
    *,
    stages,
    repeats,
    schedule='1f1b',
    max_in_flight=0,
    stage_layers=None,
):
    """(loss sum, token count) of tokens (m, rows, seq + 1), pipelined, no gradients."""
    if schedule == 'gpipe':
        return gpipe.pipelined_loss_sum(
            stage_fns, params, tokens, None, stages=stages, repeats=repeats
        )
    ticks = build_table(stages, repeats, tokens.shape[0], max_in_flight)
    loss, count, _ = run_schedule(
        stage_fns, params, tokens, None, ticks, with_grads=False, stage_layers=stage_layers
    )
    return loss, count


def run_schedule(
    stage_fns, params, tokens, row_keys, table, with_grads, bubble_fill=0.0, stage_layers=None
):
    """Run `table` (schedule.Schedule); returns (loss sum, token count, fp32 grads or None).
    bubble_fill: what empty slots and idle outputs hold (tests fill NaN: it never leaks);
    stage_layers: a StageLayers of stages of unequal depth (None: equal)."""
    shared = shared_params(params)
    p, v, m = table.stages, table.repeats, table.micro_batches
    num_layers = jax.tree.leaves(params['blocks'])[0].shape[0]
    per_chunk = num_layers // (p * v)
    fwd_kind, bwd_kind = slot_kinds(table)
    columns = dict(
        fwd_kind=fwd_kind,
        bwd_kind=bwd_kind,
        **{name: getattr(table, name) for name in schedule_lib.COLUMNS},
    )
    columns = {k: np.maximum(a, 0) for k, a in columns.items()}  # IDLE slots index 0, unused
    arrivals = dict(act=table.recv_act_slot >= 0, grad=table.recv_grad_slot >= 0)
    dtype = stage_fns.dtype
    rows, seq = tokens.shape[1], tokens.shape[2] - 1
    hidden = params['token_embed'].shape[-1]
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(mesh.shape).get('tensor', 1)
    handoff_axes = HANDOFF_AXES if seq % tensor == 0 else ACTIVATION_AXES

    def chunk_layers(repeat, stage):
        """(model index of the chunk's first layer, its layers or None: every slot)."""
        if stage_layers is None or not stage_layers.padded:
            return (repeat * p + stage) * per_chunk, None
        firsts, sizes = (jnp.asarray(a, jnp.int32) for a in stage_layers.tables())
        return firsts[repeat, stage], sizes[repeat, stage]

    def per_stage(blocks, shared, tokens, row_keys):
        stage = jax.lax.axis_index(STAGE_AXIS)
        chunks = jax.tree.map(lambda a: a.reshape(v, per_chunk, *a.shape[1:]), blocks)

        def keys_of(micro):
            return None if row_keys is None else row_keys[micro]

        def apply_chunk(chunk, h, micro, repeat):
            h = constrain(h, ACTIVATION_AXES)  # gathered over 'tensor' on arrival
            first_layer, used = chunk_layers(repeat, stage)
            return stage_fns.apply_blocks(
                chunk, h, keys_of(micro), first_layer, stage_fns.remat, used=used
            )

        def embedded(shared, micro):
            return stage_fns.embed(shared, tokens[micro, :, :-1], keys_of(micro))

        def token_loss(shared, h, micro):
            return stage_fns.head_loss_sum(shared, h, tokens[micro, :, 1:])

        def chunk_at(repeat):
            return jax.tree.map(lambda a: a[repeat], chunks)

        fill = jnp.full((rows, seq, hidden), bubble_fill, dtype)

        def stage_input(kind, shared, h, micro):
            """Chunk 0's input is the embedding (recomputed, never stashed), others' the
            stashed hand-off, gathered over 'tensor'."""
            with jax.named_scope(FIRST):
                return jax.lax.cond(  # both branches laid out alike: XLA insists
                    kind == SLOT_FIRST,
                    lambda: constrain(embedded(shared, micro), ACTIVATION_AXES),
                    lambda: constrain(h, ACTIVATION_AXES),
                )

        def chunk_fn(kind, micro, repeat):
            """The chunk as a function of its parameters, the shared ones (the embedding's,
            for chunk 0) and its stashed input: what a forward differentiates."""

            def run(params, x):
                chunk, sh = params
                return apply_chunk(chunk, stage_input(kind, sh, x, micro), micro, repeat)

            return run

        def forward_with_residuals(kind, x, micro, repeat):
            """(y, what the chunk's backward needs under stage_fns.remat, its layout): the VJP's
            residuals without the parameters (residuals.split_vjp), kept instead of
            recomputed."""
            return split_vjp(chunk_fn(kind, micro, repeat), (chunk_at(repeat), shared), x)

        # The layout of a forward's residuals, traced once: every forward has the same.
        layout_of = []

        def residual_shapes():
            def probe(x, kind, micro, repeat):
                _, kept, structure = forward_with_residuals(kind, x, micro, repeat)
                layout_of.append(structure)
                return kept

            zero = jnp.zeros((), jnp.int32)
            return jax.eval_shape(probe, fill, zero, zero, zero)

        def forward(kind, stash, resids, micro, repeat, slot, resid_slot):
            """One chunk's forward: y to the next stage, its residuals into resids[slot]."""

            def run():
                x = stash[slot]
                if not with_grads:
                    return chunk_fn(kind, micro, repeat)((chunk_at(repeat), shared), x), []
                y, kept, structure = forward_with_residuals(kind, x, micro, repeat)
                # the same program as the probe's: the same parameters in the same places
                assert structure[1] == layout_of[0][1], 'a forward kept another layout'
                return y, kept

            def idle():
                return fill, [jnp.zeros(b.shape[1:], b.dtype) for b in resids]

            with jax.named_scope(FORWARD):
                y, kept = jax.lax.cond(kind == SLOT_IDLE, idle, run)
            ran = (kind != SLOT_IDLE) & (kind != SLOT_LAST)
            return y, [write(b, resid_slot, ran, r) for b, r in zip(resids, kept)]

        def add(acc, grads):
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

        def add_chunk(acc, repeat, grads):  # dynamic slices, not scatters: XLA partitions them
            def add_one(a, g):
                total = jax.lax.dynamic_index_in_dim(a, repeat, keepdims=False) + g.astype(a.dtype)
                return jax.lax.dynamic_update_index_in_dim(a, total, repeat, 0)

            return jax.tree.map(add_one, acc, grads)

        def backward(kind, sums, stash, resids, grad_buf, micro, repeat, slot, resid_slot,
                     grad_slot):  # fmt: skip
            """One chunk's backward through the VJP its forward kept; the last chunk runs its
            forward here, then final norm, head and loss, whose gradient starts the VJP."""
            acc_blocks, acc_shared, loss = sums
            h, g = stash[slot], grad_buf[grad_slot]
            # the slot's residuals, read here: a conditional handed the whole buffers would
            # copy them (XLA:CPU does), a slice is what the branch needs
            kept_earlier = [jax.lax.dynamic_index_in_dim(b, resid_slot, 0, False) for b in resids]

            def loss_only():  # no gradients (evaluation): the last chunk's loss
                x = apply_chunk(chunk_at(repeat), constrain(h, ACTIVATION_AXES), micro, repeat)
                return (acc_blocks, acc_shared, loss + token_loss(shared, x, micro)), fill

            def head():  # the last chunk: its forward, the loss and the loss's gradient
                y, kept, _ = forward_with_residuals(kind, h, micro, repeat)
                value, (d_shared, d_y) = jax.value_and_grad(token_loss, argnums=(0, 1))(
                    shared, y, micro
                )
                return kept, d_y.astype(y.dtype), add(acc_shared, d_shared), loss + value

            def stashed():  # the forward ran in an earlier tick: its residuals, the gradient
                return kept_earlier, constrain(g, ACTIVATION_AXES), acc_shared, loss

            def run():
                with jax.named_scope(LAST):
                    kept, d_y, acc, total = jax.lax.cond(kind == SLOT_LAST, head, stashed)
                pullback = join_vjp(layout_of[0], kept, (chunk_at(repeat), shared))
                (d_chunk, d_shared), d_h = pullback(d_y)
                with jax.named_scope(FIRST):  # the embedding's half of the tied gradient
                    acc = jax.lax.cond(kind == SLOT_FIRST, lambda: add(acc, d_shared), lambda: acc)
                return (add_chunk(acc_blocks, repeat, d_chunk), acc, total), d_h

            if not with_grads:
                with jax.named_scope(EVAL), jax.named_scope(LAST):
                    return jax.lax.cond(kind == SLOT_LAST, loss_only, lambda: (sums, fill))
            with jax.named_scope(BACKWARD):
                return jax.lax.cond(kind == SLOT_IDLE, lambda: (sums, fill), run)

        def handoff(x, ring):
            return jax.lax.ppermute(constrain(x, handoff_axes), STAGE_AXIS, ring)

        def write(buffer, slot, arrived, value):
            kept = jnp.where(arrived, value, jax.lax.dynamic_index_in_dim(buffer, slot, 0, False))
            return jax.lax.dynamic_update_index_in_dim(buffer, kept, slot, 0)

        def tick(carry, row):
            act_in, grad_in, stash, resids, grad_buf, sums = carry
            row = {k: a[stage] for k, a in row.items()}
            stash = write(stash, row['recv_act_slot'], row['act'], act_in)
            grad_buf = write(grad_buf, row['recv_grad_slot'], row['grad'], grad_in)
            y, resids = forward(
                row['fwd_kind'],
                stash,
                resids,
                row['fwd_micro'],
                row['fwd_repeat'],
                row['fwd_slot'],
                row['fwd_resid_slot'],
            )
            sums, dx = backward(
                row['bwd_kind'],
                sums,
                stash,
                resids,
                grad_buf,
                row['bwd_micro'],
                row['bwd_repeat'],
                row['bwd_slot'],
                row['bwd_resid_slot'],
                row['bwd_grad_slot'],
            )
            act_in = handoff(y, [(i, (i + 1) % p) for i in range(p)])
            grad_in = handoff(dx, [(i, (i - 1) % p) for i in range(p)])
            return (act_in, grad_in, stash, resids, grad_buf, sums), None

        def buffer(slots):
            return constrain(jnp.full((slots, rows, seq, hidden), bubble_fill, dtype), handoff_axes)

        def residual_buffers():
            """One buffer per kept residual, a slot per micro-batch in flight ([] without
            gradients)."""
            if not with_grads:
                return []
            return [
                jnp.full((table.resid_slots, *r.shape), bubble_fill, r.dtype)
                if jnp.issubdtype(r.dtype, jnp.floating)
                else jnp.zeros((table.resid_slots, *r.shape), r.dtype)
                for r in residual_shapes()
            ]

        zeros32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
        sums = (zeros32(chunks), zeros32(shared), jnp.zeros((), jnp.float32))
        init = (
            constrain(fill, handoff_axes),
            constrain(fill, handoff_axes),
            buffer(table.stash_slots),
            residual_buffers(),
            buffer(table.grad_slots),
            sums,
        )
        xs = {k: jnp.asarray(a) for k, a in columns.items()}
        xs.update({k: jnp.asarray(a) for k, a in arrivals.items()})
        (*_, (acc_blocks, acc_shared, loss)), _ = jax.lax.scan(tick, init, xs)
        loss = jax.lax.psum(loss, STAGE_AXIS)
        if not with_grads:
            return (loss,)
        acc_shared = jax.lax.psum(acc_shared, STAGE_AXIS)
        acc_blocks = jax.tree.map(lambda a: a.reshape(v * per_chunk, *a.shape[2:]), acc_blocks)
        return (loss, acc_blocks, acc_shared)

    stage_spec = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), params['blocks'])
    shared_spec = jax.tree.map(lambda _: PartitionSpec(), shared)
    key_spec = None if row_keys is None else PartitionSpec()
    run = jax.shard_map(
        per_stage,
        in_specs=(stage_spec, shared_spec, PartitionSpec(), key_spec),
        out_specs=(PartitionSpec(), stage_spec, shared_spec) if with_grads else (PartitionSpec(),),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    results = run(params['blocks'], shared, tokens, row_keys)
    count = jnp.asarray(m * rows * seq, jnp.float32)
    if not with_grads:
        return results[0], count, None
    loss, block_grads, shared_grads = results
    return loss, count, {**shared_grads, 'blocks': block_grads}
