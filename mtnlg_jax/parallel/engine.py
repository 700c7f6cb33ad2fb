"""The engines behind one seam: `engine(config)` returns the one a config's layout runs.

    mesh.stage == 1                   Sequential   value_and_grad of the whole model per
                                                   micro-batch, scanned over the m of a step
    stage > 1, schedule 1f1b /        TableEngine  the static 1F1B table (pipeline.py, one
      interleaved                                  tick per row: tick_by_slot.py)
    stage > 1, schedule gpipe         GPipeEngine  autodiff of a forward scan (gpipe.py)

Every engine has the same face, which the train step, the banner, the reporter and the
planner use instead of asking the mesh or the schedule's name:

    loss_and_grads(stage_fns, params, batch)  (loss sum, token count, fp32 gradients shaped as
                                              params, side values) of batch
                                              (stage_functions.MicroBatch of m micro-batches);
                                              the gradients of loss sum + the differentiable
                                              side values
    loss_sum(stage_fns, params, batch)        (loss sum, token count, side values), no
                                              gradients
    ticks(m)                                  iterations of its loop over a step of m
    bubble_fraction(m)                        predicted share of the step stages wait
    table(m)                                  the 1F1B table (schedule.Schedule), or None
    name, pipelined                           how the banner names it; whether over 'stage'
    shared_grads_by_stage                     whether the gradients of what every stage holds
                                              (embeddings, head, final norm) come as each
                                              stage's own share, stacked over 'stage' (S, ...),
                                              for parallel/zero.py to sum
    head_stage                                the stage that runs the head (where
                                              shared_grads_by_stage)
    block_grads_share                         the share of the block parameters one micro-step's
                                              compute-dtype gradients cover (the planner's
                                              memory): 1, or 1 / v where a tick differentiates
                                              one chunk of v

stage_fns: the model's pieces (stage_functions.StageFunctions); params: the compute-dtype
parameters (blocks stage-major when pipelined). Side values: {name: fp32 array} of every value
stage_fns.values declares, combined (sum or max) over layers, chunks, micro-batches and stages;
a slot or bubble that runs no chunk contributes the identity (stage_functions.py). With none
declared they are {} and every engine compiles to the program it did before they existed.
"""

import dataclasses

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel import pipeline, rules, stage_order
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel.stage_functions import shared_params


@dataclasses.dataclass(frozen=True)
class Sequential:
    """No pipeline: the whole model per micro-batch, fp32 gradient sums over the m."""

    name = 'none (mesh.stage = 1)'
    pipelined = False
    shared_grads_by_stage = False
    block_grads_share = 1.0

    def table(self, micro_batches):
        return None

    def ticks(self, micro_batches):
        return micro_batches

    def bubble_fraction(self, micro_batches):
        return 0.0

    def loss_and_grads(self, stage_fns, params, batch):
        declared = stage_fns.values

        def micro_step(carry, micro_batch):
            grads_sum, loss_sum, token_count, values_sum = carry

            def objective(p):
                loss, count, values = _model_loss_sum(stage_fns, p, micro_batch)
                return side.objective(declared, loss, values), (loss, count, values)

            (_, (loss, count, values)), grads = jax.value_and_grad(objective, has_aux=True)(params)
            grads_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), grads_sum, grads)
            grads_sum = _constrain(grads_sum, stage_fns)
            values_sum = side.combine(declared, values_sum, values)
            return (grads_sum, loss_sum + loss, token_count + count, values_sum), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zeros = _constrain(zeros, stage_fns)
        scalar = jnp.zeros((), jnp.float32)
        init = (zeros, scalar, scalar, side.identities(declared))
        (grads_sum, loss_sum, token_count, values), _ = jax.lax.scan(micro_step, init, batch)
        return loss_sum, token_count, grads_sum, values

    def loss_sum(self, stage_fns, params, batch):
        declared = stage_fns.values

        def add_micro_batch(carry, micro_batch):
            total, values_sum = carry
            loss, count, values = _model_loss_sum(stage_fns, params, micro_batch)
            return (
                total + jnp.stack([loss, count]),
                side.combine(declared, values_sum, values),
            ), None

        init = (jnp.zeros(2, jnp.float32), side.identities(declared))
        (total, values), _ = jax.lax.scan(add_micro_batch, init, batch)
        return total[0], total[1], values


def _model_loss_sum(stage_fns, params, batch):
    """(summed loss, token count, side values) of one micro-batch through the whole model."""
    shared = shared_params(params)
    x = stage_fns.embed(shared, batch)
    x, values = stage_fns.apply_blocks(params['blocks'], x, batch, 0, stage_fns.remat)
    values = side.detach(stage_fns.values, values)
    return stage_fns.head_loss_sum(shared, x, batch), batch.token_count(), values


def _constrain(grads, stage_fns):
    if stage_fns.param_axes is None:
        return grads
    return rules.constrain_tree(grads, stage_fns.param_axes)


def for_layout(stages, repeats=1, schedule='1f1b', max_in_flight=0, stage_layers=None, **ticks):
    """The engine of a layout: Sequential without stages, else pipeline.engine_for's (ticks:
    steady_tick, fused_accumulation)."""
    if stages == 1:
        return Sequential()
    return pipeline.engine_for(stages, repeats, schedule, max_in_flight, stage_layers, **ticks)


def engine(config):
    """The engine a config runs (pipeline.options), its stages' depths from
    stage_order.of_config."""
    return for_layout(**pipeline.options(config), stage_layers=stage_order.of_config(config))


TABLES = ('token_embed', 'output_embed')  # the embedding's table, the head's (untied)


def owned_tables(config):
    """((the embedding's key, its stage), (the head's, its stage)) where the engine hands
    each table's gradients as every stage's share, zero but on the one stage that runs it,
    and those are two stages (untied tables; not the V, whose stage 0 runs both): one
    reduce-scatter over the replicas then carries both (parallel/zero.py's `pair`); None
    elsewhere."""
    if config.model.get('tie_embeddings', True):
        return None
    run = engine(config)
    if not run.shared_grads_by_stage or run.head_stage == 0:
        return None
    return ((TABLES[0], 0), (TABLES[1], run.head_stage))
