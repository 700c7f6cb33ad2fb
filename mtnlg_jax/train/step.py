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
    |   all-reduce over 'data' of loss sum and token count (2 scalars); of the model's side |
    |     values (sum or max, stage_functions.SideValue), if it declares any                |
    +---------------------------------------------------------------------------------------+
        v
    grads / tokens (the gradients of loss sum + the differentiable side values); side values
    in the metrics under their names (a differentiable one / tokens); clip by global norm (a
    scalar all-reduce), Adam moments, weight decay: all on the ZeRO shards;
    master -= lr(tokens_seen) * update
    (kept as it was if the loss or the gradient norm is not finite)

'data' above stands for the replica axes (rules.REPLICA_AXES: data and expert). Under expert
parallelism the region holds each rank's own experts (their weights split over 'expert'),
the MoE layers exchange tokens by all-to-all over 'expert' inside it (model/moe.py), and the
experts' gradients leave it per expert rank, summed over 'data' alone (parallel/zero.py).
Under context parallelism (mesh.context > 1) the region is manual over 'context' too
(rules.region_axes): each context rank holds its own places of every sequence (the windows
come whole; _micro_batches takes the rank's places), attention gathers keys and values over
'context' explicitly, and each rank's gradients, partial sums over its own tokens, leave the
region unsummed: ZeRO-1's one reduce-scatter sums them over data x context, as Megatron's
distributed optimizer does, where the partitioner would all-reduce them over 'context' after
every backward pass. The loss, token count and side values are summed over 'context' too.
Gradients are summed in fp32 across micro-steps, pipeline iterations and replicas. The
global batch arrives as (micro_steps, global_batch / micro_steps, seq + 1) with the second
axis split over 'data': each replica sees micro_batch sequences per micro-step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from mtnlg_jax import config as config_lib
from mtnlg_jax.data.batch import BATCH_AXES
from mtnlg_jax.data import packing
from mtnlg_jax.model import buffers as buffers_lib
from mtnlg_jax.model import fp8_sites
from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.parallel import context, grad_reduce, offload, rules, stage_order, zero
from mtnlg_jax.parallel import stage_functions as side
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


def accumulate_gradients(config, setup, params, tokens, row_ids, step, buffers=None):
    """Mean loss and fp32 gradients (on the ZeRO shards) over all micro-steps of the batch
    (gradients_and_values without the side values)."""
    loss, grads, _ = gradients_and_values(config, setup, params, tokens, row_ids, step, buffers)
    return loss, grads


def gradients_and_values(config, setup, params, tokens, row_ids, step, buffers=None):
    """(mean loss, fp32 gradients on the ZeRO shards, side values) over all micro-steps of
    the batch. The gradients are of loss sum + the differentiable side values, divided by the
    token count, as those values are; the others come as combined (parallel/stage_functions.py).

    Each data replica sums its own micro-batches' gradients in fp32 with no communication
    over 'data'; one reduce-scatter at the end lands the sums on the ZeRO shards (see the
    module's diagram). buffers: the model's (state['buffers']), which the model reads beside
    its parameters and which get no gradient; None for a model without any.
    """
    stage_fns = _stage_functions(setup)
    declared = stage_fns.values
    layouts = zero.layouts(setup.state_shardings['params'])
    buffers = buffers or {}
    by_stage = _stage_shares(config, params)
    # pipeline.overlap_grad_reduce: the blocks' come out of the engine on the ZeRO shards
    in_loop = layouts['blocks'] if _reduces_in_loop(config) else None
    gathers = _gathers_in_loop(config)
    model_specs = _replica_specs((setup.logical_axes, setup.buffer_axes if buffers else {}))
    if gathers:  # pipeline.overlap_param_gather: the engine gathers the blocks
        compute_params = _shards_for_the_loop(config, setup, params, layouts)
        model_specs[0]['blocks'] = jax.tree.map(_gathered_in_loop_spec, in_loop)
    else:
        compute_params = compute_copy(config, setup, params)
    grad_axes = jax.tree.map(
        lambda axes, stacked: ('stages', *axes) if stacked else axes,
        setup.logical_axes,
        by_stage,
        is_leaf=rules.is_axes,
    )

    def per_replica(model_state, tokens, row_ids):
        with rules.sequence_parallel(config.model.sequence_parallel):
            model_params = buffers_lib.beside(*model_state)
            with _fp8_weights_once(config, model_params):
                loss_sum, token_count, grads, values = _replica_sums(
                    config, stage_fns, model_params, tokens, row_ids, step, in_loop
                )
        grads = buffers_lib.without(grads, model_state[1])
        totals = zero.psum(jnp.stack([loss_sum, token_count]), rules.region_axes())
        values = side.over_axis(declared, values, rules.entry(rules.region_axes()))
        if in_loop is None:
            grads = rules.constrain_tree(grads, grad_axes)
            return totals, values, jax.tree.map(lambda g: g[None], grads)  # stacked over replicas
        rest = {k: v for k, v in grads.items() if k != 'blocks'}
        rest = rules.constrain_tree(rest, {k: v for k, v in grad_axes.items() if k != 'blocks'})
        rest = jax.tree.map(lambda g: g[None], rest)
        return totals, values, {**rest, 'blocks': grads['blocks']}  # blocks: the shards

    grad_specs = jax.tree.map(_stacked_spec, layouts, by_stage, setup.logical_axes)
    if in_loop is not None:
        grad_specs['blocks'] = jax.tree.map(_shard_spec, in_loop)

    totals, values, replica_grads = _over_replicas(
        per_replica,
        (
            PartitionSpec(),
            {name: PartitionSpec() for name in declared},
            grad_specs,
        ),
        (compute_params, buffers),
        tokens,
        row_ids,
        model_specs=model_specs,
    )
    loss_sum, token_count = totals[0], totals[1]
    pair = _owned_tables(config, layouts)
    if in_loop is None:
        grads = zero.reduce_scatter(replica_grads, layouts, by_stage, pair)
    else:
        rest = [k for k in replica_grads if k != 'blocks']
        grads = zero.reduce_scatter(
            *({k: t[k] for k in rest} for t in (replica_grads, layouts, by_stage)), pair
        )
        grads['blocks'] = jax.tree.map(
            lambda g, lay: g if grad_reduce.whole(lay) else lay.unview(g),
            replica_grads['blocks'],
            in_loop,
        )
    grads = jax.tree.map(
        lambda g, sharding: jax.lax.with_sharding_constraint(g / token_count, sharding),
        grads,
        setup.state_shardings['params'],
    )
    return loss_sum / token_count, grads, _per_token(declared, values, token_count)


def _shards_for_the_loop(config, setup, params, layouts):
    """compute_copy, but the blocks' leaves that grad_reduce.gather_chunk gathers (all but
    its `whole` ones) left as each replica's compute-dtype ZeRO shard, in the layout's view."""
    in_loop = {
        **layouts,
        'blocks': jax.tree.map(
            lambda lay: lay if grad_reduce.whole(lay) else dataclasses.replace(lay, dim=None),
            layouts['blocks'],
        ),
    }
    copy = zero.gather_compute_copy(params, in_loop, jnp.dtype(config.model.compute_dtype))
    gathered = {
        k: jax.tree.map(jax.lax.with_sharding_constraint, v, setup.compute_shardings[k])
        for k, v in copy.items()
        if k != 'blocks'
    }

    def block(x, lay, sharding):
        if grad_reduce.whole(lay):
            return jax.lax.with_sharding_constraint(x, sharding)
        return rules.constrain_spec(lay.view(x), lay.view_spec())

    blocks = jax.tree.map(
        block, copy['blocks'], layouts['blocks'], setup.compute_shardings['blocks']
    )
    return {**gathered, 'blocks': blocks}


def _gathered_in_loop_spec(layout):
    """The region's in_spec of a block leaf's compute copy under overlap_param_gather: the
    ZeRO shard's view (split over the region's axes alone), or whole."""
    if grad_reduce.whole(layout):
        return PartitionSpec()
    return rules.only(layout.view_spec(), rules.region_axes())


def _reduces_in_loop(config):
    """Whether the engine reduce-scatters the block gradients inside its loop
    (pipeline.overlap_grad_reduce, parallel/grad_reduce.py)."""
    return getattr(engine_lib.engine(config), 'overlap_grad_reduce', False)


def _gathers_in_loop(config):
    """Whether the engine all-gathers the blocks' compute copy inside its loop
    (pipeline.overlap_param_gather, with the above)."""
    return _reduces_in_loop(config) and getattr(
        engine_lib.engine(config), 'overlap_param_gather', False
    )


def _shard_spec(layout):
    """The out_spec of a block leaf's gradients on the ZeRO shards, in the layout's view (the
    engine's under pipeline.overlap_grad_reduce): split over the region's axes alone."""
    if grad_reduce.whole(layout):  # summed whole: the state's sharding slices it
        return PartitionSpec()
    return rules.only(layout.view_spec(), rules.region_axes())


def _fp8_weights_once(config, model_params):
    """Tensorwise and delayed FP8's weights quantized once a step, outside the micro-step loop
    (model/fp8_sites.py), where the block stack is one scan over every layer: no pipeline,
    no dense layers ahead of experts; elsewhere each micro-step quantizes them."""
    one_scan = not engine_lib.engine(config).pipelined and not model_params.get('dense_blocks')
    blocks = model_params['blocks'] if one_scan else None
    return fp8_sites.weights_once(fp8_sites.settings(config.model), blocks, config.model.num_layers)


def _per_token(declared, values, token_count):
    """The side values as the step reports them: a differentiable one divided by the token
    count, as the loss and its gradients are; the others as combined."""
    return {
        name: values[name] / token_count if s.differentiable else values[name]
        for name, s in declared.items()
    }


def _stage_shares(config, params):
    """A tree of bools like params: which gradients the engine leaves as each stage's own
    share, stacked over 'stage' (what every stage holds, under the 1F1B engines)."""
    stacked = engine_lib.engine(config).shared_grads_by_stage
    return {
        key: jax.tree.map(lambda _, s=stacked and key != 'blocks': s, tree)
        for key, tree in params.items()
    }


def _owned_tables(config, layouts):
    """engine.owned_tables where both tables' ZeRO shards split over ('stage', replicas)
    alike (zero.reduce_scatter's `pair`); else None."""
    pair = engine_lib.owned_tables(config)
    if pair is None:
        return None
    first, head = (layouts.get(key) for key, _ in pair)
    return pair if first == head and first and rules.is_stage_zero(first.axes) else None


def _replica_specs(logical_tree):
    """Each leaf's split over the replica axes by the rule table: whole but for an MoE
    layer's experts, which split over 'expert' (each expert rank its own)."""
    return jax.tree.map(
        lambda axes: rules.only(rules.logical_to_spec(axes), rules.REPLICA_AXES),
        logical_tree,
        is_leaf=rules.is_axes,
    )


def _stacked_spec(layout, stacked, logical_axes):
    """The out_spec of one leaf's per-replica gradient sums: stacked over its replica axes
    (zero.ShardLayout.stacked), and as its own replica split after (an expert's weights)."""
    own = () if stacked else rules.only(rules.logical_to_spec(logical_axes), rules.REPLICA_AXES)
    return PartitionSpec(rules.entry(layout.stacked), *own)


def _over_replicas(per_replica, out_specs, model_state, tokens, *per_row, model_specs=None):
    """per_replica(model_state, tokens, *per_row) in a region manual over the replica axes
    and 'context' where it splits the sequence (rules.region_axes): each replica its own rows
    of tokens (micro_steps, rows, seq + 1), whole along the sequence (each context rank
    takes its own places: _micro_batches), and of per_row (micro_steps, rows), model_state
    (the compute copy and the buffers) as `model_specs` splits it (None: whole)."""
    batch_spec = rules.logical_to_spec(BATCH_AXES)
    row_spec = PartitionSpec(*batch_spec[:2])
    model_specs = PartitionSpec() if model_specs is None else model_specs
    return jax.shard_map(
        per_replica,
        in_specs=(model_specs, batch_spec) + (row_spec,) * len(per_row),
        out_specs=out_specs,
        axis_names=set(rules.region_axes()),
        check_vma=False,  # gradients stay per replica: no implicit psum in the transpose
    )(model_state, tokens, *per_row)


def _replica_sums(config, stage_fns, compute_params, tokens, row_ids, step, in_loop=None):
    """(loss sum, token count, fp32 gradient sums, side values) of one data replica's rows:
    tokens (micro_steps, local rows, seq + 1), through the config's engine
    (parallel/engine.py). Runs inside the region manual over 'data'. in_loop: the block
    leaves' zero.ShardLayouts where the engine reduce-scatters them in its loop."""
    batch = _micro_batches(config, tokens, _row_keys(config, step, row_ids))
    engine = engine_lib.engine(config)
    if in_loop is None:
        return engine.loss_and_grads(stage_fns, compute_params, batch)
    return engine.loss_and_grads(stage_fns, compute_params, batch, grad_layouts=in_loop)


def _micro_batches(config, tokens, row_keys=None):
    """The engine's MicroBatch of token windows (micro_steps, rows, seq + 1): packed
    documents' positions, segment ids and loss mask where data.* asks for them
    (data/packing.py, None otherwise), one dropout key per row or None. Under context
    parallelism (mesh.context > 1) every field is in the chunk order (parallel/context.py),
    and the positions are the global ones where packing does not reset them; in a region
    manual over 'context' each rank's fields are its own places (the windows whole: the
    tokens and labels are read through the order)."""
    pack = packing.of_config(config)
    packed = packing.UNPACKED if pack is None else pack(tokens[..., :-1])
    if config.mesh.context == 1:
        return MicroBatch(tokens, *packed, row_keys=row_keys)
    seq = tokens.shape[-1] - 1
    order = jnp.asarray(context.chunk_order(seq, config.mesh.context))
    order = rules.own(order, 'seq', 0)  # this rank's places where 'context' is manual here
    order = jnp.broadcast_to(order, tokens.shape[:-1] + order.shape)
    packed = packing.Packed(*(None if a is None else side.in_order(a, order) for a in packed))
    if packed.positions is None:
        packed = packed._replace(positions=order)
    return MicroBatch(tokens, *packed, row_keys=row_keys, order=order)


def make_train_step(config, setup, inject=None):
    """jit(state, tokens, row_ids, tokens_after_step) -> (state, metrics); donates the state.

    A step whose loss or gradient norm is NaN or Inf leaves the parameters and optimizer
    state as they were (only `step` advances: the batch is consumed) and reports
    `skipped` = 1. inject: a variant for the fault drills (never compiled unless a drill is
    configured): 'nan' makes the loss and gradients NaN (`train.inject_nan_at_step`),
    'spike' reports 10 x the loss (`train.inject_spike_at_step`)."""
    schedule = learning_rate_schedule(config.optimizer)

    def train_step(state, tokens, row_ids, tokens_after_step):
        params, buffers = state['params'], state.get('buffers')
        loss, grads, values = gradients_and_values(
            config, setup, params, tokens, row_ids, state['step'], buffers
        )
        if inject == 'nan':
            loss, grads = loss + jnp.nan, jax.tree.map(lambda g: g + jnp.nan, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = setup.optimizer.update(grads, state['opt_state'], params)
        # The lr of the tokens seen once this batch is consumed: the first step already moves.
        lr = schedule(tokens_after_step)
        new_params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        new_buffers = buffers_after(setup, buffers, values, state['step'])
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        kept = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (new_params, opt_state, new_buffers),
            (params, state['opt_state'], buffers),
        )
        new_state = dict(params=kept[0], opt_state=kept[1], step=state['step'] + 1)
        if buffers is not None:
            new_state['buffers'] = kept[2]
        skipped = jnp.logical_not(finite).astype(jnp.int32)
        if inject == 'spike':
            loss = 10.0 * loss
        metrics = dict(loss=loss, grad_norm=grad_norm, lr=lr, skipped=skipped)
        return new_state, {**metrics, **values}  # the model's side values under their names

    return jax.jit(
        train_step,
        out_shardings=(setup.state_shardings, None),
        donate_argnums=0,
        compiler_options={
            **fp8_sites.compiler_options(config.model),
            **grad_reduce.compiler_options(_gathers_in_loop(config)),
            **offload.compiler_options(bool(config_lib.offloaded(config.model))),
            **config_lib.xla_options(config.train),  # the config's own, last
        },
    )


def buffers_after(setup, buffers, values, step):
    """The model's buffers after a step whose side values (as the step reports them) are
    `values`: each through its update rule (model/buffers.py) in plain layer order, then put
    back in the stored order; None for a model without any."""
    if buffers is None:
        return None
    layers = setup.stage_layers
    in_layer_order = stage_order.to_layer_order(buffers, layers)
    updated = buffers_lib.apply_rules(in_layer_order, setup.buffer_rules, values, step)
    return jax.tree.map(
        jax.lax.with_sharding_constraint,
        stage_order.to_schedule_order(updated, layers),
        setup.state_shardings['buffers'],
    )


def make_eval_step(config, setup):
    """jit(params, tokens[, buffers]) -> (summed loss, token count) of micro-batches tokens
    laid out as the train step's (micro_steps, rows, seq + 1), pipelined when the mesh has
    stages; buffers: the model's (state['buffers']), for a model that has them. The engines'
    side values are left out: no caller of the eval step reads them yet."""

    def eval_step(params, tokens, buffers=None):
        with rules.sequence_parallel(config.model.sequence_parallel):
            return _eval_loss_sum(params, tokens, buffers or {})

    def _eval_loss_sum(params, tokens, buffers):
        tokens = rules.constrain(tokens, BATCH_AXES)
        model_state = (compute_copy(config, setup, params), buffers)
        engine = engine_lib.engine(config)
        if engine.pipelined or config.mesh.expert > 1:  # expert parallelism: per replica
            specs = _replica_specs((setup.logical_axes, setup.buffer_axes if buffers else {}))
            totals = _over_replicas(
                _pipelined_sums, PartitionSpec(), model_state, tokens, model_specs=specs
            )
            return totals[0], totals[1]
        return _loss_sum(model_state, _micro_batches(config, tokens))

    def _pipelined_sums(model_state, tokens):
        """One replica's (loss sum, token count), summed over the replicas. Per replica, as
        in the train step: expert parallelism's all-to-all runs only in a region manual over
        'expert'; and at top level the partitioner moves the embedding's tokens between
        'data' and 'tensor' (sequence parallel) with a collective-permute whose pairs span
        every stage, inside the first chunk's conditional, which only the first stage takes:
        XLA:CPU waits for the other stages' devices forever."""
        loss, count = _loss_sum(model_state, _micro_batches(config, tokens))
        return zero.psum(jnp.stack([loss, count]), rules.region_axes())

    def _loss_sum(model_state, batch):
        model_params = buffers_lib.beside(*model_state)
        engine = engine_lib.engine(config)
        loss, count, _ = engine.loss_sum(_stage_functions(setup), model_params, batch)
        return loss, count

    return jax.jit(eval_step, compiler_options=fp8_sites.compiler_options(config.model))


def _stage_functions(setup):
    """The model's pieces for the engines; the accumulators laid out as the parameters and
    the buffers beside them."""
    axes = buffers_lib.beside(setup.logical_axes, setup.buffer_axes)
    return gpt.stage_functions(setup.graphdef, axes)
