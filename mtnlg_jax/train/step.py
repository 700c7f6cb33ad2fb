"""One optimizer step: gradient accumulation over micro-steps, ZeRO-1 update.

    fp32 master (ZeRO: split over data x tensor)
        |  cast to compute dtype, all-gather over 'data'  -> compute copy (split over tensor)
        v
    scan over micro_steps:  loss, grads = value_and_grad(micro-batch)
                            acc += fp32(grads)   acc is split over 'data': a reduce-scatter
        |
        v
    clip by global norm, Adam moments, weight decay (all on the ZeRO shards)
    master -= lr(tokens_seen) * update      (kept as it was if loss or grad norm is not finite)

The global batch arrives as (micro_steps, global_batch / micro_steps, seq + 1) with the second
axis split over 'data': each replica sees micro_batch sequences per micro-step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import pipeline, rules
from mtnlg_jax.train.optimizer import learning_rate_schedule

BATCH_AXES = ('micro_steps', 'batch', 'seq')


def micro_step_row_ids(global_batch, micro_steps):
    """(micro_steps, global_batch / micro_steps): each sequence's index in the global batch
    (its dropout key depends on it alone)."""
    return np.arange(global_batch, dtype=np.int32).reshape(micro_steps, -1)


def place_row_ids(row_ids, mesh):
    """Row ids on the mesh, laid out as the tokens' first two axes."""
    sharding = NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES[:2]))
    return jax.make_array_from_callback(row_ids.shape, sharding, lambda i: row_ids[i])


def to_micro_steps(global_batch, micro_steps):
    """(global_batch, seq + 1) -> (micro_steps, global_batch / micro_steps, seq + 1) and the
    row ids of micro_step_row_ids."""
    rows = global_batch.shape[0]
    tokens = global_batch.reshape(micro_steps, rows // micro_steps, -1)
    return tokens, micro_step_row_ids(rows, micro_steps)


def place_batch(tokens, row_ids, mesh):
    """Put a host batch held whole in memory on the mesh; each device receives only its own
    rows (the training loop reads datasets per process instead: data/loader.py)."""
    token_sharding = NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES))
    tokens = jax.make_array_from_callback(tokens.shape, token_sharding, lambda i: tokens[i])
    return tokens, place_row_ids(row_ids, mesh)


def _row_keys(config, step, row_ids):
    """One dropout key per sequence, from (seed, step, row in the global batch); None when the
    model has no dropout."""
    if config.model.hidden_dropout == 0 and config.model.attention_dropout == 0:
        return None
    step_key = jax.random.fold_in(jax.random.key(config.train.seed + 1), step)
    keys = jax.vmap(lambda row: jax.random.fold_in(step_key, row))(row_ids.reshape(-1))
    return keys.reshape(row_ids.shape)


def compute_copy(config, setup, params):
    """The compute-dtype parameters, laid out by the rule table alone (gathered over 'data')."""
    dtype = jnp.dtype(config.model.compute_dtype)
    return jax.tree.map(
        lambda p, sharding: jax.lax.with_sharding_constraint(p.astype(dtype), sharding),
        params,
        setup.compute_shardings,
    )


def accumulate_gradients(config, setup, params, tokens, row_ids, step):
    """Mean loss and fp32 gradients over all micro-steps of the global batch.

    Without a pipeline: a scan over micro-steps, each a forward and backward pass whose
    gradients are added to fp32 accumulators. With one (mesh.stage > 1): the micro-batches
    flow through the circular schedule together and one backward pass covers them all.
    """
    compute_params = compute_copy(config, setup, params)
    grad_shardings = setup.state_shardings['params']
    if config.mesh.stage > 1:
        return _pipelined_gradients(config, setup, compute_params, tokens, row_ids, step)

    def micro_step(carry, micro_batch):
        grads_sum, loss_sum, token_count = carry
        micro_tokens, micro_rows = micro_batch

        def loss_fn(p):
            return gpt.loss_sum(
                gpt.merge(setup.graphdef, p), micro_tokens, _row_keys(config, step, micro_rows)
            )

        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(compute_params)
        grads_sum = jax.tree.map(
            lambda acc, g, sharding: jax.lax.with_sharding_constraint(
                acc + g.astype(jnp.float32), sharding
            ),
            grads_sum,
            grads,
            grad_shardings,
        )
        return (grads_sum, loss_sum + loss, token_count + count), None

    zeros = jax.tree.map(
        lambda p, sharding: jax.lax.with_sharding_constraint(
            jnp.zeros(p.shape, jnp.float32), sharding
        ),
        params,
        grad_shardings,
    )
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads_sum, loss_sum, token_count), _ = jax.lax.scan(micro_step, init, (tokens, row_ids))
    grads = jax.tree.map(lambda g: g / token_count, grads_sum)
    return loss_sum / token_count, grads


def _pipelined_gradients(config, setup, compute_params, tokens, row_ids, step):
    def mean_loss(p):
        total, count = pipeline.pipelined_loss_sum(
            gpt.merge(setup.graphdef, p),
            tokens,
            _row_keys(config, step, row_ids),
            stages=config.mesh.stage,
            repeats=config.pipeline.repeats,
        )
        return total / count

    loss, grads = jax.value_and_grad(mean_loss)(compute_params)
    grads = jax.tree.map(
        lambda g, sharding: jax.lax.with_sharding_constraint(g.astype(jnp.float32), sharding),
        grads,
        setup.state_shardings['params'],
    )
    return loss, grads


def make_train_step(config, setup, inject=None):
    """jit(state, tokens, row_ids, tokens_after_step) -> (state, metrics); donates the state.

    A step whose loss or gradient norm is NaN or Inf leaves the parameters and optimizer
    state as they were (only `step` advances: the batch is consumed) and reports
    `skipped` = 1. inject: a variant for the fault drills (never compiled unless a drill is
    configured): 'nan' makes the loss and gradients NaN (`train.inject_nan_at_step`),
    'spike' reports 10 x the loss (`train.inject_spike_at_step`)."""
    schedule = learning_rate_schedule(config.optimizer)

    def train_step(state, tokens, row_ids, tokens_after_step):
        params = state['params']
        loss, grads = accumulate_gradients(config, setup, params, tokens, row_ids, state['step'])
        if inject == 'nan':
            loss, grads = loss + jnp.nan, jax.tree.map(lambda g: g + jnp.nan, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = setup.optimizer.update(grads, state['opt_state'], params)
        # The lr of the tokens seen once this batch is consumed: the first step already moves.
        lr = schedule(tokens_after_step)
        new_params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        kept = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (new_params, opt_state),
            (params, state['opt_state']),
        )
        new_state = dict(params=kept[0], opt_state=kept[1], step=state['step'] + 1)
        skipped = jnp.logical_not(finite).astype(jnp.int32)
        if inject == 'spike':
            loss = 10.0 * loss
        return new_state, dict(loss=loss, grad_norm=grad_norm, lr=lr, skipped=skipped)

    return jax.jit(train_step, out_shardings=(setup.state_shardings, None), donate_argnums=0)


def make_eval_step(config, setup):
    """jit(params, tokens) -> (summed loss, token count) of micro-batches tokens laid out as
    the train step's (micro_steps, rows, seq + 1), pipelined when the mesh has stages."""

    def eval_step(params, tokens):
        tokens = rules.constrain(tokens, BATCH_AXES)
        model = gpt.merge(setup.graphdef, compute_copy(config, setup, params))
        if config.mesh.stage > 1:
            return pipeline.pipelined_loss_sum(
                model, tokens, None, stages=config.mesh.stage, repeats=config.pipeline.repeats
            )

        def add_micro_batch(total, micro_tokens):
            loss, count = gpt.loss_sum(model, micro_tokens)
            return total + jnp.stack([loss, count]), None

        total, _ = jax.lax.scan(add_micro_batch, jnp.zeros(2, jnp.float32), tokens)
        return total[0], total[1]

    return jax.jit(eval_step)
