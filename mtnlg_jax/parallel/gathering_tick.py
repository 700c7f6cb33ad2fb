"""The gathering ticks (pipeline.overlap_param_gather): the engine's first ticks, those before
any stage runs a chunk other than its first (grad_reduce.first_tick_of_later_chunks), run
chunk 0's forwards alone and no backward. Their forward's switch also picks the layer of a
later chunk whose compute copy the slot all-gathers from its ZeRO shards (grad_reduce.py's
gather_plan draws where), written into a carried buffer: the all-gather inside the forward's
own computation, beside chunk 0's matmuls, where XLA:GPU's scheduler can hide it (the mirror
of reducing_tick.py's reduce-scatter inside the backward). A stage with fewer forward slots
there than layers to gather gathers the rest in its idle slots of those ticks (the lockstep
waits for another stage's forward then).

    tick t < first_tick_of_later_chunks, stage s:
    arrivals -> stash      forward of chunk 0 (or idle) + all-gather of chunk k's layer l
                           into gathered[k][l]      no backward: dx = the fill
    y -> stage s + 1, the fill -> stage s - 1

The rest of the ticks run in a second scan on the chunks so gathered (pipeline.scan_ticks).
"""

import dataclasses
import functools

import jax

from mtnlg_jax.parallel import grad_reduce, tick_by_slot
from mtnlg_jax.parallel.branches import GATHER


def run(stage, init, columns, warm):
    """(the carry after the gathering ticks, the stage on every chunk gathered): the scan of
    the ticks before warm.ticks from `init` (the engine's carry), columns: the table's
    (branches.Columns); warm: pipeline.Warm (the later chunks' ZeRO shards' views)."""
    plan, layouts = warm.plan, stage.reduce[1]
    prepared = None if stage.prepared is None else stage.prepared[:1]
    first = dataclasses.replace(stage, chunks=stage.chunks[:1], prepared=prepared)
    buffers = grad_reduce.gather_buffers(plan, stage.index, warm.views, layouts)
    xs = (jax.tree.map(lambda a: a[: warm.ticks], columns), plan.columns())
    body = functools.partial(tick, first, plan, warm.views)
    (carry, buffers), _ = jax.lax.scan(body, (init, buffers), xs)
    gathered = tuple(grad_reduce.unview_chunk(b, layouts) for b in buffers)
    return carry, stage.with_chunks((stage.chunks[0], *gathered))


def tick(stage, plan, views, carry, xs):
    """The scan's body: one gathering tick; carry (the engine's, the gathered buffers), xs
    (branches.Columns, grad_reduce.Plan.columns of gather_plan: every stage's row)."""
    (act_in, grad_in, stash, resids, grad_buf, *rest), buffers = carry
    columns, gather_columns = xs
    row = jax.tree.map(lambda a: a[stage.index], columns)
    branch, chunk, layer = (a[stage.index] for a in gather_columns)
    stash, grad_buf = tick_by_slot.receive(stage, row, act_in, grad_in, stash, grad_buf)
    pick = functools.partial(_pick, plan, views, stage.reduce[1], buffers, branch)
    y, resids, values, piece = tick_by_slot.forward(stage, row.forward, stash, resids, pick)
    tap_bufs, sums, *shards = rest
    sums = (*sums[:3], stage.combine(sums[3], values))
    buffers = grad_reduce.write_piece(buffers, chunk - 1, layer, piece)
    act_in, grad_in = tick_by_slot.send(stage, y, stage.fill)
    return ((act_in, grad_in, stash, resids, grad_buf, tap_bufs, sums, *shards), buffers), None


def _pick(plan, views, layouts, buffers, branch, idle, run):
    """The forward's switch on `branch`: idle (0), chunk 0's forward (1), or a variant's
    (ran, k, l): the forward (ran 1) or none beside the all-gather of chunk k's layer l, in
    one computation; (the slot's (y, values), kept), one layer's gathered views."""

    def plain(ran):
        return (run if ran else idle)(), grad_reduce.no_piece(buffers)

    def variant(ran, k, n):
        return (run if ran else idle)(), grad_reduce.gather_layer(views[k - 1], n, layouts)

    branches = [functools.partial(plain, 0), functools.partial(plain, 1)]
    branches += [functools.partial(variant, *key) for key in plan.variants]
    with jax.named_scope(GATHER):
        return jax.lax.switch(branch, branches)
