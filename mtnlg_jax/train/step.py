"""One optimizer step, communicating as Megatron's distributed optimizer does.

    fp32 master + Adam moments: ZeRO-1 shards (rule table + split over 'data')
        |  cast to the compute dtype on the shard
        |  ALL-GATHER over 'data', compute dtype ............ once per step (compute_copy)
        v
    compute copy: rule table (split over tensor / stage, whole over data)
    +-- shard_map manual over 'data': one data replica, its own rows -----------------------+
    |   engine(config).loss_and_grads (parallel/engine.py), over the micro-steps:           |
    |     Sequential (no stages): scan of value_and_grad(micro-batch), over 'tensor' only   |
    |       by the rule table: 2 all-reduces per layer forward (sequence parallel: 2        |
    |       reduce-scatters + 2 all-gathers), the same backward; acc += fp32(grads)         |
    |     1F1B / interleaved / GPipe: their own shard_map over 'stage'; 1F1B leaves each    |
    |       stage's share of the embedding's and head's gradients unsummed                  |
    |     fp32 gradient sums of all micro-batches, nothing over 'data'                      |
    |   REDUCE-SCATTER over 'data', fp32 ............. once per step, onto the ZeRO shards  |
    |     (over 'stage' and 'data' together for what every stage holds: rules.state_spec)   |
    |   all-reduce over 'data' of loss sum and token count (2 scalars)                      |
    +---------------------------------------------------------------------------------------+
        v
    grads / tokens; clip by global norm (a scalar all-reduce), Adam moments, weight decay:
    all on the ZeRO shards; master -= lr(tokens_seen) * update
    (kept as it was if the loss or the gradient norm is not finite)

'data' above stands for the replica axes (rules.REPLICA_AXES). Gradients are summed in fp32
across micro-steps, pipeline iterations and replicas. The global batch arrives as
(micro_steps, global_batch / micro_steps, seq + 1) with the second axis split over 'data':
each replica sees micro_batch sequences per micro-step.
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from mtnlg_jax.data.batch import BATCH_AXES
from mtnlg_jax.data import packing
from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.parallel import rules, zero
from mtnlg_jax.parallel.stage_functions import MicroBatch
from mtnlg_jax.train.optimizer import learning_rate_schedule


def _row_keys(config, step, row_ids):
    """One dropout key per sequence, from (seed, step, row in the global batch); None when the
    model has no dropout."""
    if config.model.hidden_dropout == 0 and config.model.attention_dropout == 0:
        return None
    step_key = jax.random.fold_in(jax.random.key(config.train.seed + 1), step)
    keys = jax.vmap(lambda row: jax.random.fold_in(step_key, row))(row_ids.reshape(-1))
    return keys.reshape(row_ids.shape)


def compute_copy(config, setup, params):
    """The compute-dtype parameters, laid out by the rule table: each replica casts its ZeRO
    shard, then one all-gather over 'data' in the compute dtype."""
    layouts = zero.layouts(setup.state_shardings['params'])
    gathered = zero.gather_compute_copy(params, layouts, jnp.dtype(config.model.compute_dtype))
    return jax.tree.map(jax.lax.with_sharding_constraint, gathered, setup.compute_shardings)


def accumulate_gradients(config, setup, params, tokens, row_ids, step):
    """Mean loss and fp32 gradients (on the ZeRO shards) over all micro-steps of the batch.

    Each data replica sums its own micro-batches' gradients in fp32 with no communication
    over 'data'; one reduce-scatter at the end lands the sums on the ZeRO shards (see the
    module's diagram).
    """
    layouts = zero.layouts(setup.state_shardings['params'])
    compute_params = compute_copy(config, setup, params)
    by_stage = _stage_shares(config, params)
    grad_axes = jax.tree.map(
        lambda axes, stacked: ('stages', *axes) if stacked else axes,
        setup.logical_axes,
        by_stage,
        is_leaf=rules.is_axes,
    )

    def per_replica(compute_params, tokens, row_ids):
        with rules.sequence_parallel(config.model.sequence_parallel):
            loss_sum, token_count, grads = _replica_sums(
                config, setup, compute_params, tokens, row_ids, step
            )
        totals = zero.psum(jnp.stack([loss_sum, token_count]))
        grads = rules.constrain_tree(grads, grad_axes)
        return totals, jax.tree.map(lambda g: g[None], grads)  # stacked over replicas

    totals, replica_grads = _over_replicas(
        per_replica,
        (PartitionSpec(), PartitionSpec(rules.REPLICAS)),
        compute_params,
        tokens,
        row_ids,
    )
    loss_sum, token_count = totals[0], totals[1]
    grads = jax.tree.map(
        lambda g, sharding: jax.lax.with_sharding_constraint(g / token_count, sharding),
        zero.reduce_scatter(replica_grads, layouts, by_stage),
        setup.state_shardings['params'],
    )
    return loss_sum / token_count, grads


def _stage_shares(config, params):
    """A tree of bools like params: which gradients the engine leaves as each stage's own
    share, stacked over 'stage' (what every stage holds, under the 1F1B engines)."""
    stacked = engine_lib.engine(config).shared_grads_by_stage
    return {
        key: jax.tree.map(lambda _, s=stacked and key != 'blocks': s, tree)
        for key, tree in params.items()
    }


def _over_replicas(per_replica, out_specs, compute_params, tokens, *per_row):
    """per_replica(compute_params, tokens, *per_row) in a region manual over the replica axes
    (rules.REPLICA_AXES; a context axis would stay automatic: it splits the sequence): each
    replica its own rows of tokens (micro_steps, rows, seq + 1) and of per_row (micro_steps,
    rows), the whole compute copy."""
    batch_spec = rules.logical_to_spec(BATCH_AXES)
    row_spec = PartitionSpec(*batch_spec[:2])
    return jax.shard_map(
        per_replica,
        in_specs=(PartitionSpec(), batch_spec) + (row_spec,) * len(per_row),
        out_specs=out_specs,
        axis_names=set(rules.REPLICA_AXES),
        check_vma=False,  # gradients stay per replica: no implicit psum in the transpose
    )(compute_params, tokens, *per_row)


def _replica_sums(config, setup, compute_params, tokens, row_ids, step):
    """(loss sum, token count, fp32 gradient sums) of one data replica's rows: tokens
    (micro_steps, local rows, seq + 1), through the config's engine (parallel/engine.py).
    Runs inside the region manual over 'data'."""
    batch = _micro_batches(config, tokens, _row_keys(config, step, row_ids))
    stage_fns = gpt.stage_functions(setup.graphdef, setup.logical_axes)
    return engine_lib.engine(config).loss_and_grads(stage_fns, compute_params, batch)


def _micro_batches(config, tokens, row_keys=None):
    """The engine's MicroBatch of token windows (micro_steps, rows, seq + 1): packed
    documents' positions, segment ids and loss mask where data.* asks for them
    (data/packing.py, None otherwise), one dropout key per row or None."""
    pack = packing.of_config(config)
    packed = packing.UNPACKED if pack is None else pack(tokens[..., :-1])
    return MicroBatch(tokens, *packed, row_keys=row_keys)


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
        with rules.sequence_parallel(config.model.sequence_parallel):
            return _eval_loss_sum(params, tokens)

    def _eval_loss_sum(params, tokens):
        tokens = rules.constrain(tokens, BATCH_AXES)
        compute_params = compute_copy(config, setup, params)
        engine = engine_lib.engine(config)
        if engine.pipelined:
            totals = _over_replicas(_pipelined_sums, PartitionSpec(), compute_params, tokens)
            return totals[0], totals[1]
        stage_fns = gpt.stage_functions(setup.graphdef, setup.logical_axes)
        return engine.loss_sum(stage_fns, compute_params, _micro_batches(config, tokens))

    def _pipelined_sums(compute_params, tokens):
        """One replica's (loss sum, token count), summed over 'data'. Per replica, as in the
        train step: at top level the partitioner moves the embedding's tokens between 'data'
        and 'tensor' (sequence parallel) with a collective-permute whose pairs span every
        stage, inside the first chunk's conditional, which only the first stage takes: XLA:CPU
        waits for the other stages' devices forever."""
        stage_fns = gpt.stage_functions(setup.graphdef, setup.logical_axes)
        batch = _micro_batches(config, tokens)
        loss, count = engine_lib.engine(config).loss_sum(stage_fns, compute_params, batch)
        return zero.psum(jnp.stack([loss, count]))

    return jax.jit(eval_step)
