"""Communication bytes one device sends per step, by collective kind and mesh axis, from the
formulas of the literature (ring algorithms: an all-reduce of S bytes over n devices sends
2 (n-1)/n S, a reduce-scatter or all-gather (n-1)/n S, a point-to-point hand-off S).

    tensor  (t)  Megatron: per layer and micro-batch of b sequences, 2 all-reduces of the
                 (b, s, h) activation forward and 2 backward; full recompute repeats the
                 forward's (Megatron: 6 per layer), less the last one of a recomputed single
                 layer, whose result only the discarded output needs (XLA removes it). The
                 vocabulary-parallel embedding and tied head add one each per micro-batch
                 (lookup forward, input gradient backward). With sequence parallelism each
                 all-reduce of a layer becomes a reduce-scatter + an all-gather: the same bytes;
                 under selective recompute the backward gathers the attention's and the MLP's
                 inputs again for their weights' gradients (the sequence shard is what is
                 kept, as in Megatron): 6 all-gathers a layer and 4 reduce-scatters.
    stage   (p)  one (b, s, h) hand-off per pipeline iteration forward and one backward; the
                 circular schedule runs v m + p - 1 iterations on every stage, bubble included
    1F1B engine  (pipeline.schedule 1f1b / interleaved; parallel/pipeline.py) per device, the
                 mean over stages: every chunk runs its forward v m times (2 all-reduces per
                 layer) and its backward v m times (2 per layer, 4 with remat = full, which
                 recomputes each layer's forward, less the dead one of a single-layer chunk);
                 the embedding's all-reduce runs m / p times, the head's input gradient m / p;
                 two hand-offs per tick of the table (four in zbv's V: output and gradient
                 each sent both ways, parallel/tick_by_slot.py), split over tensor along the
                 sequence (when it divides), each gathered where it is used: by the forward
                 of every chunk but the first, and by the backward of every chunk but the
                 last (its gradient) and of the last (its input: its forward runs in that
                 tick); each stage sums its own share of the gradients of the parameters
                 outside the block stack (which every stage holds)
    context (c)  context parallelism (parallel/context.py): per layer and micro-batch pass,
                 one all-gather of the layer's keys and values ((b, s, 2 kv_heads / t, d),
                 gathered whole) forward, again where the backward recomputes the layer, and
                 one reduce-scatter of their gradients backward; the activations the other
                 axes move are 1 / c of a sequence. The gradients of what is replicated over
                 'context' leave the train step's region as each rank's partial sums
                 (rules.region_axes): ZeRO-1's reduce-scatter sums them (below)
    data    (d)  ZeRO-1 / distributed optimizer: one reduce-scatter of the fp32 gradients onto
                 the ZeRO shards and one all-gather of the compute-dtype parameters per step,
                 independent of the micro-batch count, over each parameter's replica axes
                 (rules.replica_axes): 'data' alone for a mixture of experts' routed experts
                 (split over 'expert'), 'data' and 'expert' (d x devices) for every other
                 parameter; with 'stage' too (d x p devices) for the parameters every stage
                 holds, which sums the stages' shares too (without replicas: one all-reduce
                 over stage of them, in fp32). Under context parallelism the shards split
                 over 'context' too, so each reduce-scatter and all-gather is over its
                 replica axes and 'context' (e.g. 'data+context'), once a step as Megatron's
                 distributed optimizer's over data x context. Keys name the axes as the compiled
                 inventory does (hlo.axes_key: mesh order, axes of size 1 left out), e.g.
                 'data+expert'

    expert  (x)  a mixture of experts' dispatch and combine: per MoE layer and micro-batch, an
                 all-to-all of the micro-batch's tokens' k choices to their experts' ranks and
                 one back, forward, and two backward (their gradients), run as often as the
                 tensor all-reduces of a layer (recompute included; under selective
                 recompute the backward also repeats the forward's two, which the saved
                 names do not cover: 6 a layer pass, measured), each of the exchange's
                 fixed buffers, (b s k x padding, h) rows (arithmetic.expert_padding: X / k
                 dropless, about the capacity factor else): each device sends (x-1)/x of the
                 rows, a tensor rank its own copy. Over 'tensor' the experts' row-parallel
                 all-reduce then carries those buffers' rows, not (b, s, h), the other half
                 of a layer's all-reduces (under sequence parallelism: the attention's
                 reduce-scatter and all-gather, the experts' all-gather of their input and
                 all-reduce of their rows). Folded (model.moe.fold_tensor, x t ranks,
                 key 'expert+tensor'): each tensor rank sends its 1/t share of the buffers,
                 (b s k x padding / t, h) rows, to the x t - 1 others; over 'tensor' no
                 experts' all-reduce, but the exchange's all-gather of its input (and
                 back whole without sequence parallelism) and reduce-scatter of the tokens'
                 sums: the dense MLP's bytes; selective recompute keeps the exchanged rows,
                 so the backward runs no all-to-all again (4 a layer pass, not 6)

Scalars (loss, gradient norm, the cross-entropy's (b, s) reductions over the vocabulary) are
left out: kilobytes against gigabytes.
"""

import math

from mtnlg_jax.config import shared_ffn_hidden
from mtnlg_jax.model.layers import attention_dims
from mtnlg_jax.model.moe import experts_of
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.parallel.rules import MESH_AXES, REPLICA_AXES, STAGE_AXIS
from mtnlg_jax.plan.arithmetic import (
    chunk_slots,
    engine_table,
    exchange_ranks,
    expert_padding,
    folded,
    itemsize,
    local_paired_table,
    local_param_counts,
    local_shared_params,
    mesh_sizes,
)

ZERO_KINDS = ('reduce-scatter', 'all-gather')


def _ring(kind, size, group):
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return (2 * share if kind == 'all-reduce' else share) * size


def tensor_allreduces_per_micro_batch(config):
    """All-reduces over 'tensor' one device runs per pass of one micro-batch through its
    layers (its L / p of them), forward + recompute + backward."""
    model = config.model
    stages, repeats = config.mesh.stage, config.pipeline.repeats
    layers = chunk_slots(config) * repeats  # the deepest stage's
    count = 4 * layers
    if model.remat == 'full':
        # The recompute's last all-reduce of a checkpointed segment is dead code when the
        # segment is one layer (XLA removes it; measured): without a pipeline every layer is
        # one, with one a chunk of several layers recomputes as a scan and keeps it.
        chunk_layers = layers // repeats
        segments = layers if stages == 1 or chunk_layers == 1 else 0
        count += 2 * layers - segments
    return count


def _engine_tensor_runs(config):
    """(layer all-reduces, embedding + head all-reduces, hand-off gathers) one device runs per
    step in the 1F1B engine, the mean over stages (see the module docstring)."""
    model = config.model
    stages, repeats, micro = config.mesh.stage, config.pipeline.repeats, config.train.micro_steps
    # every chunk runs the deepest chunk's slots: a padding slot runs its layer, collectives
    # included (model/gpt.py's apply_block_stack)
    chunk_layers = chunk_slots(config)
    passes, per_stage = repeats * micro, micro / stages
    per_backward = 2 * chunk_layers
    if model.remat == 'full':
        per_backward = 4 * chunk_layers - (1 if chunk_layers == 1 else 0)
    layer_runs = passes * (2 * chunk_layers + per_backward)
    edge_runs = 2 * per_stage
    gathers = (passes - per_stage) + passes
    return layer_runs, edge_runs, gathers


def _tensor_runs(config, table):
    """(layer all-reduces, embedding + head all-reduces, hand-off gathers) per device per step:
    the 1F1B engine's when `table`, else a plain or GPipe step's (no hand-off gathers)."""
    if table is not None:
        return _engine_tensor_runs(config)
    layer_passes_, edge_passes = layer_passes(config)
    return layer_passes_ * tensor_allreduces_per_micro_batch(config), 2 * edge_passes, 0


def layer_passes(config):
    """(passes of a micro-batch through a device's layers, passes through embedding and head)
    per step: m without a pipeline; v m + p - 1 iterations of one chunk (1 / v of the layers)
    with one, and m / p micro-batches of embedding and head when p divides m (else all m:
    pipelined_loss_sum)."""
    stages, repeats, micro = config.mesh.stage, config.pipeline.repeats, config.train.micro_steps
    if stages == 1:
        return micro, micro
    iterations = repeats * micro + stages - 1
    return iterations / repeats, micro // stages if micro % stages == 0 else micro


def exchanged_rows(config):
    """(rows of a mixture of experts' tensor all-reduce per token, 1 if its shared experts
    add one of their own else 0) under expert parallelism: model/moe.py's exchange sums the
    experts' row-parallel outputs over 'tensor' on its buffers, k x padding rows a token,
    before they go back, and the shared experts' output apart (measured: docs/benchmarks.md,
    "Mixtral 8x22B on 256 H100s"). (0, 0) where the layer's MLP all-reduce is the block's
    (b, s, h) one."""
    model = config.model
    if not experts_of(model) or exchange_ranks(config) <= 1:
        return 0, 0
    shared = int(shared_ffn_hidden(model) > 0)
    if folded(config):  # whole experts: the (b, s, h) sums of a dense MLP, none on buffers
        return 0, shared
    return model.moe.top_k * expert_padding(config), shared


def exchange_axes(config):
    """The mesh axes of a mixture of experts' all-to-alls: ('expert',), folded ('expert',
    'tensor')."""
    return ('expert', 'tensor') if folded(config) else ('expert',)


def exchange_kind(config):
    """The collective that carries a mixture of experts' rows (model/moe_exchange.py):
    'all-to-all' of the padded buffers, or 'ragged-all-to-all' (the plan counts it at the
    same buffers: an upper bound on what it sends, as plan/hlo.py counts it)."""
    ragged = config.model.get('moe', {}).get('exchange') == 'ragged'
    return 'ragged-all-to-all' if ragged else 'all-to-all'


def all_to_all_bytes(config, table=None):
    """Bytes one device sends per step by the all-to-alls over 'expert' (folded: expert x
    tensor, each tensor rank its 1/t of the rows) of a mixture of experts (the module
    docstring; 0 for a dense model or one exchange rank)."""
    model, x = config.model, exchange_ranks(config)
    if not experts_of(model) or x <= 1:
        return 0.0
    rows = config.train.micro_batch * model.seq_len * model.moe.top_k * expert_padding(config)
    rows /= config.mesh.tensor if folded(config) else 1
    payload = rows * model.hidden * itemsize(model.compute_dtype)
    runs, _, _ = _tensor_runs(config, engine_table(config) if table is None else table)
    if model.remat == 'selective' and not folded(config):  # the backward exchanges again
        runs *= 1.5  # (folded, the exchanged rows are kept: model/moe.py's SAVED_NAMES)
    return runs * (x - 1) / x * payload


def comm_bytes_per_device(config):
    """{kind: {axis: bytes one device sends per step}} (kinds and axes with traffic only)."""
    model, mesh = config.model, config.mesh
    e = itemsize(model.compute_dtype)
    context = mesh.get('context', 1)
    activation = config.train.micro_batch * model.seq_len // context * model.hidden * e
    table = engine_table(config)
    handoff = activation
    if table is not None and model.seq_len % mesh.tensor == 0:
        handoff = activation / mesh.tensor  # split along the sequence (pipeline.HANDOFF_AXES)
    sequence_parallel = model.get('sequence_parallel', False)
    out = {}

    def add(kind, axis, size):
        per_axis = out.setdefault(kind, {})
        per_axis[axis] = per_axis.get(axis, 0.0) + size

    if mesh.tensor > 1:
        layer_runs, edge_runs, gathers = _tensor_runs(config, table)
        rows, shared = exchanged_rows(config)
        fold = folded(config)
        if rows or fold:  # half the layer runs are the experts'
            layer_runs /= 2
            size = rows * activation  # unfolded: an all-reduce of their buffers' rows
            add('all-reduce', 'tensor', layer_runs * _ring('all-reduce', size, mesh.tensor))
            kind = 'reduce-scatter' if sequence_parallel else 'all-reduce'  # the shared MLP's
            add(kind, 'tensor', shared * layer_runs * _ring(kind, activation, mesh.tensor))
        if fold:  # the exchange gathers its input and reduce-scatters the tokens' sums
            _add_folded(add, config, layer_runs, activation)
        if sequence_parallel:  # each layer all-reduce: a reduce-scatter + an all-gather
            for kind in ('reduce-scatter', 'all-gather'):
                add(kind, 'tensor', layer_runs * _ring(kind, activation, mesh.tensor))
            gather = _ring('all-gather', activation, mesh.tensor)
            if model.remat == 'selective':  # the backward gathers the two inputs again
                add('all-gather', 'tensor', layer_runs / 2 * gather)
            if rows:  # the experts' input gathered along the sequence (unfolded)
                add('all-gather', 'tensor', layer_runs * gather)
        elif handoff < activation:
            add('all-gather', 'tensor', gathers * _ring('all-gather', activation, mesh.tensor))
        runs = edge_runs + (0 if sequence_parallel else layer_runs)
        add('all-reduce', 'tensor', runs * _ring('all-reduce', activation, mesh.tensor))
    if all_to_all_bytes(config, table):
        axes = axes_key(config, exchange_axes(config))
        add(exchange_kind(config), axes, all_to_all_bytes(config, table))
    engine = engine_lib.engine(config)
    compute, _ = local_param_counts(config)
    if engine.pipelined:
        iterations = engine.ticks(config.train.micro_steps)
        # the shared parameters ZeRO does not split over 'stage' too: their stage shares
        # are summed on their ZeRO shards (over data x expert: they are no experts)
        rest = local_shared_params(config, joint=False)
        if table is not None and rest:
            size = 4 * rest / (mesh.data * mesh.expert)  # fp32, on its ZeRO shard
            add('all-reduce', 'stage', _ring('all-reduce', size, mesh.stage))
        sent = 4 if table is not None and table.v_shape else 2  # the V sends both ways
        add('collective-permute', 'stage', sent * iterations * handoff)
    if context > 1:
        _add_context(add, config, e)
    paired = local_paired_table(config)
    for axes, count in zero_groups(config, compute):
        # ZeRO-1's shards split over 'context' too (rules.zero_axes): the reduce-scatter
        # sums each context rank's partial gradients, the all-gather runs over both
        over = (*axes, 'context') if context > 1 else axes
        group = math.prod(mesh_sizes(config)[a] for a in over)
        both = 2 * paired if STAGE_AXIS in axes else 0  # the tables' sums go as below
        for kind, size in zip(ZERO_KINDS, (4 * (count - both), e * count)):
            if group > 1:
                add(kind, axes_key(config, over), _ring(kind, size, group))
        if both:  # one table's bytes over the replicas, then 2 / R of one over 'stage'
            replicas = group // mesh.stage
            add(
                'reduce-scatter',
                axes_key(config, over[1:]),
                _ring('reduce-scatter', 4 * paired, replicas),
            )
            add('reduce-scatter', 'stage', _ring('reduce-scatter', 4 * both / replicas, mesh.stage))
    return out


def _add_folded(add, config, runs, activation):
    """comm_bytes_per_device's tensor traffic of a folded exchange, `runs` layer runs:
    the input's all-gather along the sequence and the tokens' sums reduce-scattered back
    (selective recompute keeps the exchanged rows: neither runs again); without sequence
    parallelism gathered whole after."""
    t, sequence_parallel = config.mesh.tensor, config.model.get('sequence_parallel', False)
    gathers = runs * (1 if sequence_parallel else 1.5)  # the forward half gathers back
    add('all-gather', 'tensor', gathers * _ring('all-gather', activation, t))
    add('reduce-scatter', 'tensor', runs * _ring('reduce-scatter', activation, t))


def zero_groups(config, compute=None):
    """[(mesh axes, compute-copy elements per device)] of ZeRO-1's collectives (the module
    docstring): the routed experts over 'data'; the rest of the block stack over the replica
    axes; what every stage holds, where ZeRO splits it over 'stage' too (rules.state_spec),
    over 'stage' and the replica axes. compute: local_param_counts(config)[0], if known."""
    if compute is None:
        compute, _ = local_param_counts(config)
    experts = local_param_counts(config, routed_experts=True)[0] if experts_of(config.model) else 0
    joint = local_shared_params(config, joint=True)
    groups = (
        (REPLICA_AXES[:1], experts),
        (REPLICA_AXES, compute - experts - joint),
        ((STAGE_AXIS, *REPLICA_AXES), joint),
    )
    return [(axes, count) for axes, count in groups if count]


def axes_key(config, axes):
    """The key of a group over `axes`, as the compiled inventory writes it (hlo.axes_key):
    the axes above size 1, in mesh order; 'none' if no axis is."""
    sizes = mesh_sizes(config)
    kept = [a for a in MESH_AXES if a in axes and sizes[a] > 1]
    return '+'.join(kept) if kept else 'none'


def zero_bytes(comm):
    """[(kind, axes key, bytes)] of ZeRO-1's collectives in a comm_bytes_per_device (or a
    compiled inventory's) dict: reduce-scatters and all-gathers over a group holding a
    replica axis (rules.REPLICA_AXES)."""
    return [
        (kind, key, size)
        for kind in ZERO_KINDS
        for key, size in comm.get(kind, {}).items()
        if set(key.split('+')) & set(REPLICA_AXES)
    ]


def _add_context(add, config, e):
    """comm_bytes_per_device's 'context' traffic (the module docstring)."""
    model, context = config.model, config.mesh.context
    heads, kv_heads, head_dim = attention_dims(model)
    rows = config.train.micro_batch
    kv = rows * model.seq_len * 2 * kv_heads // config.mesh.tensor * head_dim * e
    passes = layer_passes(config)[0] * chunk_slots(config) * config.pipeline.repeats
    gathers = passes * (2 if model.remat != 'none' else 1)
    add('all-gather', 'context', gathers * _ring('all-gather', kv, context))
    add('reduce-scatter', 'context', passes * _ring('reduce-scatter', kv, context))


def by_axis(comm):
    """{axis: bytes} summed over kinds, from comm_bytes_per_device's or the inventory's form."""
    out = {}
    for per_axis in comm.values():
        for axis, value in per_axis.items():
            out[axis] = out.get(axis, 0.0) + value
    return out
