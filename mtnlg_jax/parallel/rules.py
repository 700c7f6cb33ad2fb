"""Logical axis names -> mesh axes: the one place that knows the mesh.

The model names every parameter dimension and every large activation dimension logically
(`batch`, `embed`, `heads`, ...). This table turns those names into a PartitionSpec over the
mesh ('data', 'stage', 'tensor'); changing the parallel layout means changing this table,
never the model. The tensor-parallel rows are Megatron's:

    QKV kernel     (embed, qkv, heads, head_dim)   heads  -> tensor   column parallel
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
    activations    (batch, ...)                    batch  -> data

ZeRO-1: optimizer state (fp32 master weights and Adam moments) is additionally split over
'data' along its first whole dimension that divides evenly, else along a split dimension that
still divides (`zero_spec`).
"""

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

LOGICAL_RULES = (
    ('batch', 'data'),
    ('vocab', 'tensor'),
    ('heads', 'tensor'),
    ('mlp', 'tensor'),
    ('embed', None),
    ('head_dim', None),
    ('qkv', None),
    ('seq', None),
    ('kv_seq', None),
    ('position', None),
    ('layers', 'stage'),  # block parameters: each pipeline stage holds its own chunks
    ('micro_steps', None),
    ('stages', 'stage'),  # micro-batches outside the pipeline: embedding and head, 1/p each
)
ZERO_AXIS = 'data'

_RULES = dict(LOGICAL_RULES)


def logical_to_spec(logical_axes):
    """PartitionSpec of a tuple of logical names (None: a dimension kept whole)."""
    mesh_axes = []
    for name in logical_axes:
        if name is not None and name not in _RULES:
            raise KeyError(f'logical axis {name!r} has no rule in LOGICAL_RULES')
        mesh_axes.append(None if name is None else _RULES[name])
    return PartitionSpec(*mesh_axes)


def constrain(x, logical_axes):
    """Pin an activation's layout by the logical names of its trailing dimensions (leading
    ones are left to XLA); a no-op when no mesh is set."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    leading = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - len(logical_axes))
    return jax.lax.with_sharding_constraint(
        x, PartitionSpec(*leading, *logical_to_spec(logical_axes))
    )


def zero_spec(spec, shape, mesh_shape):
    """`spec` with 'data' added for ZeRO-1: on the first whole dimension that the data size
    divides, else on the first split dimension that still divides evenly (e.g. an MLP bias
    split over tensor becomes split over (tensor, data)); else left as it is."""
    data_size = mesh_shape[ZERO_AXIS]
    if data_size == 1:
        return spec
    axes = list(spec) + [None] * (len(shape) - len(spec))
    for dim, (axis, size) in enumerate(zip(axes, shape)):
        if axis is None and size % data_size == 0:
            axes[dim] = ZERO_AXIS
            return PartitionSpec(*axes)
    for dim, (axis, size) in enumerate(zip(axes, shape)):
        split = (axis,) if isinstance(axis, str) else tuple(axis or ())
        if split and size % (math.prod(mesh_shape[a] for a in split) * data_size) == 0:
            axes[dim] = split + (ZERO_AXIS,)
            return PartitionSpec(*axes)
    return spec  # too small to split evenly: kept whole on every replica


def compute_shardings(logical_tree, mesh):
    """NamedShardings of parameters as used in compute: the rule table, no ZeRO split."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes)), logical_tree, is_leaf=_is_axes
    )


def zero_shardings(logical_tree, abstract_params, mesh):
    """NamedShardings of the fp32 master copy and optimizer moments: rule table + ZeRO split."""
    return jax.tree.map(
        lambda axes, leaf: NamedSharding(
            mesh, zero_spec(logical_to_spec(axes), leaf.shape, dict(mesh.shape))
        ),
        logical_tree,
        abstract_params,
        is_leaf=_is_axes,
    )


def _is_axes(x):
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
