"""The fused accumulation's backward with several chunks a stage (pipeline.fused_accumulation,
interleaved, the tick by slot): a conditional per chunk, chained.

    for chunk k:    cond(idle, another chunk's or the head's slot,
                         hand through (acc_k, the chain),                 in place (true branch)
                         chunk k's backward; acc_k + its dW GEMMs)        in one computation
    the last chunk: cond(not the head's slot, hand through, its forward, head, loss and
                         backward; acc + its dW GEMMs)
    for chunk k:    cond(idle or another chunk's, hand through, acc_k + the QKV's dW)
    the chain: (loss, side values, the input's gradient, the QKV's taps), and the shared
    parameters' gradient through chunk 0's and the head's (the others have none); the first
    link's skip hands on the last tick's (`scratch`, carried by the scan)

A branch runs its chunk's backward and contracts the kernels' taps (each matmul's x and dy,
parallel/taps.py, gathered as the matmuls read them) into the chunk's accumulators in fp32:
the dW GEMMs (the add their epilogue) share one computation with the dgrad GEMMs and their
tensor reduce-scatters, so XLA:GPU's scheduler can hide one under the other (the MLP's
output projection's dW, whose taps need no gather, is what it runs beside them). All but the
layer's first site's (QKV's, Llama's Q and KV: the last the backward reaches, whose dW the
scheduler put after everything): its taps leave the branch and its dW GEMM runs in a
conditional of its own after the chain, holding no collective, behind which the stage
hand-offs run (XLA:GPU starts no collective-permute before a conditional holding
collectives, and every link holds some).

The accumulators go in as a conditional's operand, handed through by its true branch, never
into a nested conditional: XLA:GPU copies a buffer handed through a false branch, or through
one whose other branch hands it to a conditional of its own. So the head is a conditional of
its own, not nested in the last chunk's (only the last chunk, v - 1, runs the head; only
chunk 0 the embedding). The shared parameters' accumulators are added to after the chain
(stage.Stage.add_shared), where the slot touched them: a slot that did not hands on stale values.
"""

import contextlib

import jax

from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel import taps
from mtnlg_jax.parallel.branches import ACCUMULATE, BACKWARD_CHUNK, LAST, SLOT_IDLE, SLOT_LAST
from mtnlg_jax.parallel.slots import add_unless


def scratch(stage):
    """The scan's carry the chain starts from: (the shared parameters' gradient, the deferred
    sites' taps), what a skipped first link hands on in place of zeros (Stage.fused, several
    chunks, by slot; [] otherwise)."""
    if not (stage.fused and len(stage.chunks) > 1 and stage.pairs is None):
        return []
    (deferred, _), _ = _split(stage.sites)
    deferred = taps.hold(taps.zeros(deferred, stage.per_chunk), deferred)
    return [jax.tree.map(jax.numpy.zeros_like, stage.shared), deferred]


def _split(sites, stashed=None):
    """((the deferred sites, their taps), (the others, theirs)): deferred, the layer's first
    site (QKV's; Llama's Q) and those sharing its x (Llama's KV)."""
    stashed = [()] * len(sites) if stashed is None else stashed
    first = [i for i, site in enumerate(sites) if i == 0 or site.shares == 0]
    rest = [i for i in range(len(sites)) if i not in first]
    return taps.subset(sites, stashed, first), taps.subset(sites, stashed, rest)


def backward(stage, bwd, sums, h, g, kept, carried):
    """(sums + the slot's gradients, the input's gradient, the chain's scratch for the next
    tick) of a stage.Stage with several chunks under the fused accumulation: bwd its backward
    slot (branches.Backward), h the last chunk's stashed input, g the output's gradient, kept
    the slot's residuals, carried the last tick's scratch."""
    acc_blocks, acc_shared, loss, acc_values = sums
    d_values = side.cotangents(stage.fns.values)
    idle, head = bwd.kind == SLOT_IDLE, bwd.kind == SLOT_LAST
    d_shared, deferred = carried
    _, _, value, values, dx, _ = stage.no_gradients()
    chain, accumulated = (value, values, dx, deferred), list(acc_blocks)
    for k, chunk in enumerate(stage.chunks):

        def stashed(chunk=chunk, k=k):
            return stage.stashed_gradients(chunk, k, g, kept, d_values)

        shared = d_shared if k == 0 else None  # the embedding's: chunk 0's alone
        skip = idle | head | (bwd.repeat != k)
        accumulated[k], chain, shared = _link(stage, skip, stashed, accumulated[k], chain, shared)
        d_shared = shared if k == 0 else d_shared

    def last():
        k = len(stage.chunks) - 1
        return stage.head_gradients(stage.chunks[k], k, bwd, h, d_values)

    accumulated[-1], chain, d_shared = _link(
        stage, ~head, last, accumulated[-1], chain, d_shared, LAST
    )
    value, values, dx, deferred = chain
    with jax.named_scope(ACCUMULATE):  # the deferred sites' dW, where the slot ran the chunk
        accumulated = [
            add_unless(idle | (bwd.repeat != k), acc, deferred, _deferred_add(stage))
            for k, acc in enumerate(accumulated)
        ]
    acc_shared = stage.add_shared(bwd, acc_shared, d_shared)
    sums = (tuple(accumulated), acc_shared, loss + value, stage.combine(acc_values, values))
    return sums, dx, [d_shared, deferred]


def _link(stage, skip, gradients, acc, chain, shared, scope=None):
    """(acc, chain, shared) handed through where `skip`, else (acc + the chunk's gradients
    but the deferred sites' dW, the chain's new values, the shared parameters' gradient; shared
    None: the link has none); gradients(): Stage.pull_back's tuple for one chunk; scope: a
    named scope inside BACKWARD_CHUNK's (the head's: LAST)."""

    def run(acc, _, __):
        d_chunk, d_shared, value, values, dx, tapped = gradients()
        (_, deferred), (sites, rest) = _split(stage.sites, tapped)
        acc = taps.add_weight_grads(taps.add_untapped(acc, d_chunk, stage.sites), sites, rest)
        return acc, (value, values, dx, deferred), None if shared is None else d_shared

    inner = contextlib.nullcontext() if scope is None else jax.named_scope(scope)
    with jax.named_scope(BACKWARD_CHUNK), inner:
        return jax.lax.cond(skip, lambda *a: a, run, acc, chain, shared)


def _deferred_add(stage):
    (sites, _), _ = _split(stage.sites)

    def add(acc, deferred):
        return taps.add_weight_grads(acc, sites, deferred)

    return add
