"""Logical axis names -> mesh axes: the one place that knows the mesh.

The mesh's axes are MESH_AXES, outermost first: the config's mesh.* keys in the key table's
order (config/keys.py, which the command line reads before JAX is imported), laid over the
devices by parallel/mesh.py:

    MESH_AXES     data   stage   expert   context   tensor
    REPLICA_AXES  data           expert                       the batch, ZeRO-1, the train
                                                              step's per-replica region

The model names every parameter dimension and every large activation dimension logically
(`batch`, `embed`, `heads`, ...). This table turns those names into a PartitionSpec over the
mesh; changing the parallel layout means changing this table, never the model. The
tensor-parallel rows are Megatron's:

    QKV kernel     (embed, qkv, heads, head_dim)   heads  -> tensor   column parallel
    (GQA: Q kernel (embed, heads, head_dim), KV kernel (embed, qkv, kv_heads, head_dim):
    heads and kv_heads -> tensor, so each rank holds whole query groups and their K/V head)
    attn-out       (heads, head_dim, embed)        heads  -> tensor   row parallel, 1 all-reduce
    MLP-in         (embed, mlp)                    mlp    -> tensor   column parallel
    MLP-out        (mlp, embed)                    mlp    -> tensor   row parallel, 1 all-reduce
    stacked blocks (layers, ...)                   layers -> stage    each pipeline stage holds
                                                                      its own layers (see
                                                                      parallel/pipeline.py)
    embedding      (vocab, embed)                  vocab  -> tensor   vocabulary parallel; the
                                                                      tied output layer and the
                                                                      cross-entropy stay on the
                                                                      vocabulary shards
    expert weights (layers, experts, ...)          experts -> expert  each expert rank holds
                                                                      its own experts (below)
    folded experts (layers, experts, ...)   -> (expert, tensor)       parallel folding: each
                                                                      expert whole on one rank
    activations    (batch, ...)                    batch  -> REPLICA_AXES (data, expert)

The replica axes are those the batch's rows and ZeRO-1's shards split over: the train step's
region is manual over them (train/step.py), and the loss and token psum and the gradient
reduce-scatter run over them (parallel/zero.py).

Expert parallelism (`mesh.expert`, MoE models only): an MoE layer's stacked expert weights
split over 'expert' by expert; for every other parameter expert ranks are data-parallel
replicas, so the batch splits over data x expert. Within the train step's region (manual over
both) each rank routes its own tokens and an all-to-all over 'expert' carries them to the
ranks of their experts and back (model/moe.py). A leaf's own replica axes (`replica_axes`)
are those that do not split it: the experts' gradients are summed and ZeRO-sharded over
'data' alone, everything else's over ('data', 'expert'). At mesh.expert 1 'expert' is left
out of every ZeRO spec and collective, so the compiled steps are those of a mesh without it
(bench/hlo_diff.py).

`context` splits the sequence, not the batch: never a replica axis. `seq` and the residual
stream's `residual_seq` map to 'context' (parallel/context.py: each rank holds chunks r and
2c - 1 - r); attention gathers keys and values over it (`kv_seq`). The train step's region
is manual over it too (`region_axes`): each context rank's gradients of what is replicated
over it leave the region as partial sums, and ZeRO-1's shards split over it after the
replica axes (`zero_axes`), so one reduce-scatter over data x context sums them, as
Megatron's distributed optimizer does. In such a region the model sees its own tokens only:
`shards(name, manual=...)` tells the pieces it holds from those still split, and `gather`,
`own` and `total` move a sequence between them where the whole one is needed.

Sequence parallelism (Korthikanti et al. 2022; `model.sequence_parallel`): the residual
stream, where layer norms, dropout and residual adds run, names its sequence dimension
`residual_seq`. Off, that name maps to nothing and every tensor rank repeats that work; on,
it maps to 'tensor', so XLA turns each row-parallel all-reduce into a reduce-scatter onto
sequence shards and gathers the sequence again before each column-parallel matmul:

                  LN, dropout, residual          QKV .. attn-out / MLP-in .. MLP-out
    off:  x (b, s, h) whole on every rank  ->  all-reduce after each row-parallel matmul
    on:   x (b, s/t, h) on tensor rank i   ->  all-gather before QKV / MLP-in,
                                               reduce-scatter after attn-out / MLP-out

ZeRO-1: optimizer state (fp32 master weights and Adam moments) is additionally split over
the replica axes along its first whole dimension that divides evenly, else along a split
dimension that still divides (`zero_spec`).
"""

import contextlib
import contextvars
import functools
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from mtnlg_jax.config import keys

MESH_AXES = keys.MESH_AXES
REPLICA_AXES = ('data', 'expert')
STAGE_AXIS = 'stage'
EXPERT_AXIS = 'expert'
CONTEXT_AXIS = 'context'  # what `seq` splits over (parallel/context.py)
TENSOR_AXIS = 'tensor'
FOLDED_AXES = (EXPERT_AXIS, TENSOR_AXIS)  # the MoE layers' expert ranks under folding


def entry(names):
    """One PartitionSpec entry of a tuple of mesh axes: a single axis by its name."""
    return names[0] if len(names) == 1 else tuple(names)


REPLICAS = entry(REPLICA_AXES)  # the entry of a dimension split over the replicas

LOGICAL_RULES = (
    ('batch', REPLICAS),
    ('vocab', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),  # grouped-query attention: mesh.tensor divides model.kv_heads
    ('mlp', 'tensor'),
    # A mixture of experts' stacked expert weights (model/moe.py): each expert rank holds its
    # own experts; each expert's own MLP width splits over tensor as `mlp` does (column
    # parallel in, row parallel out). The router's scores over the experts are whole.
    ('experts', EXPERT_AXIS),
    ('expert_mlp', 'tensor'),
    # Parallel folding (model.moe.fold_tensor): the tensor ranks are more expert ranks, each
    # expert whole on one rank of expert x tensor (its width named None).
    ('folded_experts', FOLDED_AXES),
    ('expert_scores', None),
    ('embed', None),
    ('head_dim', None),
    ('q_per_kv', None),  # the query heads of one key/value head
    ('qkv', None),
    ('seq', 'context'),  # context parallelism: each rank its chunks (parallel/context.py)
    ('residual_seq', 'context'),  # ('context', 'tensor') under sequence parallelism
    ('kv_seq', None),  # keys and values gathered over 'context' for attention
    ('window', None),  # a batch's token windows (seq + 1), split only once chunked
    ('position', None),
    ('layers', 'stage'),  # block parameters: each pipeline stage holds its own chunks
    ('dense_layers', None),  # the dense layers ahead of the experts: every stage, as embeddings
    ('micro_steps', None),
    ('stages', 'stage'),  # micro-batches outside the pipeline: embedding and head, 1/p each
    ('handoff_seq', ('context', 'tensor')),  # activations between pipeline stages (Megatron's)
)
SEQUENCE_PARALLEL_RULES = (('residual_seq', ('context', 'tensor')),)

_RULES = dict(LOGICAL_RULES)
_ACTIVE_RULES = contextvars.ContextVar('mtnlg_jax_logical_rules', default=_RULES)


@contextlib.contextmanager
def sequence_parallel(enabled):
    """Within this context (while a step is traced), `residual_seq` maps to 'tensor' if
    `enabled` (`model.sequence_parallel`); outside it, to nothing."""
    rules = {**_RULES, **dict(SEQUENCE_PARALLEL_RULES)} if enabled else _RULES
    token = _ACTIVE_RULES.set(rules)
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def logical_to_spec(logical_axes):
    """PartitionSpec of a tuple of logical names (None: a dimension kept whole)."""
    rules = _ACTIVE_RULES.get()
    mesh_axes = []
    for name in logical_axes:
        if name is not None and name not in rules:
            raise KeyError(f'logical axis {name!r} has no rule in LOGICAL_RULES')
        mesh_axes.append(None if name is None else rules[name])
    return PartitionSpec(*mesh_axes)


def shards(logical_name, manual=None):
    """How many pieces the mesh and the active rules split a dimension named `logical_name`
    into (1 without a mesh, or where the name maps to nothing). manual: True counts only the
    mesh axes manual where it is called (the array here is one of those pieces already),
    False only the others (the pieces the array here is still split into), None all."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = logical_to_spec((logical_name,))[0]
    if mesh.empty or axes is None:
        return 1
    names = _names(axes)
    if manual is not None:
        names = [a for a in names if (a in mesh.manual_axes) == manual]
    return math.prod(mesh.shape[a] for a in names)


def region_axes():
    """The mesh axes the train step's per-replica region is manual over (train/step.py): the
    replica axes, and 'context' where above 1, so that each context rank's gradients (its
    own tokens' partial sums) leave the region unsummed and ZeRO-1's reduce-scatter sums
    them once a step over the replicas and 'context' together (parallel/zero.py), where the
    partitioner would all-reduce them over 'context' after every backward pass."""
    mesh = jax.sharding.get_abstract_mesh()
    context = not mesh.empty and mesh.shape.get(CONTEXT_AXIS, 1) > 1
    return REPLICA_AXES + ((CONTEXT_AXIS,) if context else ())


def _manual_names(logical_name):
    """The mesh axes a dimension named `logical_name` splits over that are manual here."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = logical_to_spec((logical_name,))[0]
    return tuple(a for a in _names(axes) if a in mesh.manual_axes)


def gather(x, logical_axes, axis):
    """x (laid out by `logical_axes`) whole along `axis`: an all-gather over the mesh axes its
    name there splits over that are manual here (the pieces in rank order; its transpose
    reduce-scatters), on each device's own shards of the others (local_call: XLA would
    gather those first); x as it is where none are manual (the partitioner gathers what a
    constraint asks for)."""
    names = _manual_names(logical_axes[axis])
    if not names:
        return x
    gathered = functools.partial(jax.lax.all_gather, axis_name=entry(names), axis=axis, tiled=True)
    return local_call(gathered, (x,), logical_axes)


def own(x, logical_name, axis):
    """gather's inverse: this device's piece of x (whole along `axis`)."""
    names = _manual_names(logical_name)
    if not names:
        return x
    size = x.shape[axis] // math.prod(jax.lax.axis_size(a) for a in names)
    start = jax.lax.axis_index(entry(names)) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def piece_index(logical_name):
    """This device's index among the pieces of a dimension named `logical_name` over the mesh
    axes manual here (a context rank's, where 'context' is), None where none are."""
    names = _manual_names(logical_name)
    return jax.lax.axis_index(entry(names)) if names else None


def total(x, logical_name):
    """x summed over the mesh axes a dimension named `logical_name` splits over that are
    manual here (a sum over that dimension's pieces); x as it is where none are."""
    names = _manual_names(logical_name)
    return jax.lax.psum(x, entry(names)) if names else x


def constrain(x, logical_axes):
    """Pin an activation's layout by the logical names of its trailing dimensions (leading
    ones are left to XLA); a no-op when no mesh is set. Inside a `shard_map` region, mesh axes
    that are manual there are dropped: the region already holds one shard of them (e.g. a data
    replica's own rows, where 'batch' -> 'data' no longer applies)."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    leading = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - len(logical_axes))
    return constrain_spec(x, PartitionSpec(*leading, *logical_to_spec(logical_axes)))


def constrain_spec(x, spec):
    """with_sharding_constraint to a PartitionSpec of the mesh, less the axes that are manual
    where it is called (the identity within a region manual over every axis)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return jax.lax.with_sharding_constraint(
        x, PartitionSpec(*(_without(axes, manual) for axes in spec))
    )


def local_call(fn, args, logical_axes, replicated=(), args_axes=None):
    """fn(*args, *replicated) on each device's own shards: a nested shard_map manual over every
    mesh axis not manual here already, for a kernel whose partitioning rule fails where some
    axes are manual (cuDNN's attention inside the train step's region manual over 'data' and
    the pipeline's over 'stage'), or that has none (a Pallas kernel). The result is laid out
    by `logical_axes`, and so is every arg unless `args_axes` names each arg's own;
    `replicated` args are whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*args, *replicated)
    manual = set(mesh.manual_axes)
    names = set(mesh.axis_names) - manual
    if not names:
        return fn(*args, *replicated)

    def spec(axes):
        return PartitionSpec(*(_without(a, manual) for a in logical_to_spec(axes)))

    in_axes = args_axes if args_axes is not None else (logical_axes,) * len(args)
    return jax.shard_map(
        fn,
        in_specs=tuple(spec(axes) for axes in in_axes) + (PartitionSpec(),) * len(replicated),
        out_specs=spec(logical_axes),
        axis_names=names,
        check_vma=False,
    )(*args, *replicated)


def gather_context(x, axis):
    """Inside a region manual over 'context' (local_call): x whole along `axis` (its
    context ranks' shards in rank order, an all-gather; its transpose reduce-scatters), and
    this device's context rank."""
    gathered = jax.lax.all_gather(x, CONTEXT_AXIS, axis=axis, tiled=True)
    return gathered, jax.lax.axis_index(CONTEXT_AXIS)


def constrain_tree(tree, logical_tree):
    """`constrain` every leaf of `tree` by the logical names at the same place of
    `logical_tree` (e.g. gradient accumulators laid out as the parameters)."""
    return jax.tree.map(lambda axes, x: constrain(x, axes), logical_tree, tree, is_leaf=is_axes)


def only(spec, kept):
    """`spec` with each entry cut to the mesh axes in `kept` (a region's manual axes: what
    its in_specs and out_specs may name)."""
    dropped = set(MESH_AXES) - set(kept)
    return PartitionSpec(*(_without(axes, dropped) for axes in spec))


def _without(axes, dropped):
    """One PartitionSpec entry without the mesh axes in `dropped`."""
    if axes is None or axes is PartitionSpec.UNCONSTRAINED:
        return axes
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in dropped)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def replicas(mesh_shape):
    """How many replicas a mesh of `mesh_shape` ({axis: size}) has: its REPLICA_AXES' sizes
    multiplied (an axis it lacks counts 1)."""
    return math.prod(mesh_shape.get(a, 1) for a in REPLICA_AXES)


def replica_axes(spec, mesh_shape):
    """The replica axes a leaf of `spec` is summed and ZeRO-split over: 'data' always (it marks
    the ZeRO split, parallel/zero.py), the others where above 1 and not splitting the leaf
    already (an expert's weights, split over 'expert': 'data' alone)."""
    taken = {a for axes in spec for a in _names(axes)}
    return tuple(
        a
        for a in REPLICA_AXES
        if a == REPLICA_AXES[0] or (a not in taken and mesh_shape.get(a, 1) > 1)
    )


def zero_axes(spec, mesh_shape):
    """The mesh axes a leaf of `spec`'s ZeRO-1 shards split over: its replica axes, then
    'context' where above 1 (Megatron's distributed optimizer shards over data x context
    too). The gradients arrive as each context rank's partial sums (region_axes) and one
    reduce-scatter over all of these axes sums them onto the shards (parallel/zero.py)."""
    context = (CONTEXT_AXIS,) if mesh_shape.get(CONTEXT_AXIS, 1) > 1 else ()
    return replica_axes(spec, mesh_shape) + context


def stage_zero_axes(spec, mesh_shape):
    """ZeRO-1's axes of what every pipeline stage holds (state_spec): 'stage', then the
    leaf's ZeRO axes."""
    return (STAGE_AXIS, *zero_axes(spec, mesh_shape))


def is_stage_zero(axes):
    """Whether a PartitionSpec entry is a split over 'stage' and the replicas together."""
    names = _names(axes)
    return len(names) > 1 and names[0] == STAGE_AXIS and names[1] == REPLICA_AXES[0]


def zero_spec(spec, shape, mesh_shape, axis_name=None, whole_only=False):
    """`spec` with the leaf's ZeRO axes (zero_axes; or `axis_name`, one mesh axis or a tuple)
    added for ZeRO-1: on the first whole dimension that its size divides, else (unless
    whole_only) on the first split dimension that still divides evenly (e.g. an MLP bias split
    over tensor becomes split over (tensor, data)); else left as it is. At mesh.expert 1 the
    experts' dimension counts as whole, so the state is split as on a mesh without 'expert'
    (the same compiled step: bench/hlo_diff.py)."""
    if mesh_shape.get(EXPERT_AXIS, 1) == 1:  # the experts' dimension whole: split as before
        spec = PartitionSpec(*(_without(axes, {EXPERT_AXIS}) for axes in spec))
    if axis_name is None:
        axis_name = entry(zero_axes(spec, mesh_shape))
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    data_size = math.prod(mesh_shape[a] for a in names)
    if data_size == 1:
        return spec
    axes = list(spec) + [None] * (len(shape) - len(spec))
    for dim, (axis, size) in enumerate(zip(axes, shape)):
        if axis is None and size % data_size == 0:
            axes[dim] = axis_name
            return PartitionSpec(*axes)
    for dim, (axis, size) in enumerate(zip(axes, shape)):
        split = _names(axis)
        if whole_only or not split:
            continue
        if size % (math.prod(mesh_shape[a] for a in split) * data_size) == 0:
            axes[dim] = split + names
            return PartitionSpec(*axes)
    return spec  # too small to split evenly: kept whole on every replica


def state_spec(spec, shape, mesh_shape):
    """The spec of a parameter's fp32 state (master copy and moments): the rule table's plus
    ZeRO-1's split. A parameter every pipeline stage holds (embeddings, head, final norm: no
    'stage' in its spec) is split over ('stage', *replica_axes) together where a whole
    dimension allows: each stage sums only its own share of its gradients, and one
    reduce-scatter over both axes lands them (parallel/zero.py), instead of an all-reduce over
    'stage' first."""
    if (
        mesh_shape.get(STAGE_AXIS, 1) > 1
        and math.prod(mesh_shape[a] for a in zero_axes(spec, mesh_shape)) > 1
        and not any(STAGE_AXIS in _names(axes) for axes in spec)
    ):
        joint = stage_zero_axes(spec, mesh_shape)
        joint = zero_spec(spec, shape, mesh_shape, joint, whole_only=True)
        if joint != spec:
            return joint
    return zero_spec(spec, shape, mesh_shape)


def _names(axes):
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def layer_order_shardings(logical_tree, abstract_params, mesh):
    """NamedShardings of the state's blocks in plain layer order where the layers do not
    divide over 'stage' (stages of unequal depth: what checkpoints hold): zero_shardings'
    specs with 'stage' taken off the layer axis and put, as ZeRO puts 'data', on another
    dimension it divides, so a device holds about as much as in the stage-major order."""
    mesh_shape = dict(mesh.shape)

    def spec(axes, leaf):
        base = logical_to_spec(axes)
        if not any(STAGE_AXIS in _names(a) for a in base):  # in no layer order: as stored
            return state_spec(base, leaf.shape, mesh_shape)
        base = PartitionSpec(*(_without(a, {STAGE_AXIS}) for a in base))
        return zero_spec(
            zero_spec(base, leaf.shape, mesh_shape), leaf.shape, mesh_shape, STAGE_AXIS
        )

    return jax.tree.map(
        lambda axes, leaf: NamedSharding(mesh, spec(axes, leaf)),
        logical_tree,
        abstract_params,
        is_leaf=is_axes,
    )


def compute_shardings(logical_tree, mesh):
    """NamedShardings of parameters as used in compute: the rule table, no ZeRO split."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes)), logical_tree, is_leaf=is_axes
    )


def zero_shardings(logical_tree, abstract_params, mesh):
    """NamedShardings of the fp32 master copy and optimizer moments: rule table + ZeRO split."""
    return jax.tree.map(
        lambda axes, leaf: NamedSharding(
            mesh, state_spec(logical_to_spec(axes), leaf.shape, dict(mesh.shape))
        ),
        logical_tree,
        abstract_params,
        is_leaf=is_axes,
    )


def is_axes(x):
    """Whether x is a leaf of a logical-axes tree: a tuple of names (or None)."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
