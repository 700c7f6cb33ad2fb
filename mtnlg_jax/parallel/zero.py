"""ZeRO-1's two collectives over the replicas (rules.REPLICA_AXES: 'data', named so below),
written out rather than left to the partitioner.

    fp32 master shard --cast--> compute-dtype shard --all-gather over data--> compute copy
    fp32 gradient sums of each replica --reduce-scatter over data--> fp32 gradient shard

Under context parallelism the shards split over 'context' after the replica axes too
(rules.zero_axes): the gradients arrive as each context rank's partial sums over its own
tokens, stacked over 'context' as over the replicas (the train step's region is manual over
both: rules.region_axes), and one reduce-scatter over both sums and shards them, as
Megatron's distributed optimizer does over data x context; the all-gather runs over both.

Each runs once per step in a `shard_map` manual over every mesh axis (XLA replicates the
automatic axes of a collective's operand in a partly manual region, which would gather every
tensor shard first), so the compiled step shows exactly one all-gather in the compute dtype
and one fp32 reduce-scatter per parameter, as Megatron's distributed optimizer does.

Where a leaf's ZeRO shard is (rules.zero_spec): one dimension of size S split over 'data',
alone or after the axes that already split it, e.g. ('tensor', 'data') over T x D devices:

    S viewed as (n, D, r), n = T (1 when 'data' splits a whole dimension), r = S / (n D)
    tensor rank i, data rank j holds  [i, j, :]   = elements (i D + j) r ... (i D + j + 1) r

so in the view 'data' splits an axis of its own, the collectives act on it, and the reshapes
to and from the view move nothing. Leaves too small to split (zero_spec leaves them whole) are
summed with an all-reduce instead.

What every pipeline stage holds (embeddings, head, final norm) is split over ('stage', 'data')
together (rules.state_spec): its gradients arrive as each stage's own partial sums, stacked
over 'stage', and one reduce-scatter over both axes sums and shards them; the all-gather of
its compute copy runs over both axes too.

'data' stands for a leaf's own replica axes (rules.replica_axes): ('data', 'expert') under
expert parallelism, but 'data' alone for an MoE layer's experts, which 'expert' splits by
expert: their gradients arrive stacked over 'data' only, each expert rank's its own experts'.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mtnlg_jax.parallel.rules import (
    REPLICA_AXES,
    STAGE_AXIS,
    constrain_spec,
    entry,
    is_stage_zero,
    zero_axes,
)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One leaf's ZeRO spec and where its 'data' split is: dimension `dim` (None: none),
    viewed as (groups, data, rest) with `before` the mesh axes that split `groups`; `axes`
    the leaf's replica axes (rules.replica_axes: its gradients are summed over them), which
    its ZeRO split is over ('context' last where it splits: rules.zero_axes), with 'stage'
    first for what every stage holds."""

    spec: tuple
    dim: int | None
    before: tuple = ()
    groups: int = 1
    data: int = 1
    axes: tuple = REPLICA_AXES[:1]

    @property
    def stacked(self):
        """The mesh axes the train step stacks this leaf's per-replica gradients over."""
        return self.axes[1:] if is_stage_zero(self.axes) else self.axes

    def view(self, x, offset=0):
        """x (with `offset` leading axes before the leaf's own) with dimension `dim` reshaped
        to (groups, data, rest)."""
        if self.dim is None:
            return x
        d = self.dim + offset
        return x.reshape(*x.shape[:d], self.groups, self.data, -1, *x.shape[d + 1 :])

    def unview(self, x):
        if self.dim is None:
            return x
        d = self.dim
        return x.reshape(*x.shape[:d], -1, *x.shape[d + 3 :])

    def view_spec(self, with_data=True):
        """PartitionSpec of the view over the whole mesh (with_data False: gathered)."""
        if self.dim is None:
            return PartitionSpec(*self.spec)
        groups = (self.before[0] if len(self.before) == 1 else self.before) or None
        data = (self.axes[0] if len(self.axes) == 1 else self.axes) if with_data else None
        d = self.dim
        return PartitionSpec(*self.spec[:d], groups, data, None, *self.spec[d + 1 :])


def layouts(zero_shardings):
    """ShardLayouts of a tree of NamedShardings made by rules.zero_shardings."""

    def layout(sharding):
        sizes = dict(sharding.mesh.shape)
        spec = tuple(sharding.spec)
        for dim, axes in enumerate(spec):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            if is_stage_zero(axes):
                return ShardLayout(spec, dim, data=math.prod(sizes[a] for a in axes), axes=axes)
            if REPLICA_AXES[0] in axes:  # the replica axes follow those that split `groups`
                first = axes.index(REPLICA_AXES[0])
                before, zero = axes[:first], axes[first:]
                groups = math.prod(sizes[axis] for axis in before)
                data = math.prod(sizes[axis] for axis in zero)
                return ShardLayout(spec, dim, before, groups, data, zero)
        return ShardLayout(spec, None, axes=zero_axes(spec, sizes))

    return jax.tree.map(layout, zero_shardings)


def psum(x, axes=None):
    """Inside a region manual over the replica axes: the sum over replicas, or over `axes` of
    them (XLA rejects a cross-device sum over mesh axes of size 1: those are left out)."""
    axes = REPLICA_AXES if axes is None else axes
    axes = tuple(a for a in axes if jax.lax.axis_size(a) > 1)
    return jax.lax.psum(x, entry(axes)) if axes else x


def _specs(layout_tree, **kwargs):
    return jax.tree.map(lambda lay: lay.view_spec(**kwargs), layout_tree)


def gather_compute_copy(params, layout_tree, dtype):
    """The compute-dtype copy of ZeRO-sharded parameters: each replica casts its own shard,
    then one all-gather over 'data' in the compute dtype."""

    def gather(x, lay):
        if lay.dim is None or lay.data == 1:
            return x
        return jax.lax.all_gather(x, lay.axes, axis=lay.dim + 1, tiled=True)

    views = jax.tree.map(lambda p, lay: lay.view(p.astype(dtype)), params, layout_tree)
    views = jax.tree.map(lambda x, lay: constrain_spec(x, lay.view_spec()), views, layout_tree)
    gathered = jax.shard_map(
        lambda views: jax.tree.map(gather, views, layout_tree),
        in_specs=(_specs(layout_tree),),
        out_specs=_specs(layout_tree, with_data=False),
        check_vma=False,
    )(views)
    return jax.tree.map(lambda x, lay: lay.unview(x), gathered, layout_tree)


def reduce_scatter(per_replica, layout_tree, by_stage=None, pair=None):
    """The fp32 sums over replicas on the ZeRO shards. per_replica: each leaf's gradient sums
    of every replica, stacked on a leading axis split over 'data' (D, *leaf shape); where
    `by_stage` (a tree of bools like layout_tree; None: nowhere) says so, each stage's own
    partial sums, stacked over 'stage' after it (D, S, *leaf shape). pair: ((key, stage),
    (key, stage)), two top-level leaves of one layout, each stage's share, whose sums are
    zero but on their own stage (the embedding's table and the head's): one reduce-scatter
    carries both (`_owned_pair`)."""
    if by_stage is None:
        by_stage = jax.tree.map(lambda _: False, layout_tree)

    def scatter(x, lay, stacked):
        x = x[0][0] if stacked else x[0]  # this replica's (and stage's) own sums
        if is_stage_zero(lay.axes):
            if not stacked:  # whole on every stage: one stage's copy enters the sum
                x = jnp.where(jax.lax.axis_index(STAGE_AXIS) == 0, x, jnp.zeros_like(x))
            return jax.lax.psum_scatter(x, lay.axes, scatter_dimension=lay.dim + 1, tiled=True)
        if lay.dim is None:
            x = psum(x, lay.axes)
        elif lay.data > 1:
            if math.prod(jax.lax.axis_size(a) for a in lay.axes) > 1:
                x = jax.lax.psum_scatter(
                    x, entry(lay.axes), scatter_dimension=lay.dim + 1, tiled=True
                )
        # the stages' shares summed on the ZeRO shard: 1 / d of the bytes of a sum before it
        return jax.lax.psum(x, STAGE_AXIS) if stacked else x

    def view(x, lay, stacked):
        return lay.view(x, offset=2 if stacked else 1)

    def in_spec(lay, stacked):
        leading = entry(lay.stacked)
        leading = (leading, STAGE_AXIS) if stacked else (leading,)
        return PartitionSpec(*leading, *lay.view_spec(with_data=False))

    def scatter_all(views):
        if pair is None:
            return jax.tree.map(scatter, views, layout_tree, by_stage)
        keys, owners = zip(*pair)
        rest = [k for k in views if k not in keys]
        scattered = {k: jax.tree.map(scatter, views[k], layout_tree[k], by_stage[k]) for k in rest}
        a, b = (views[key][0][0] for key in keys)
        return {**scattered, **_owned_pair(a, b, owners, layout_tree[keys[0]], keys)}

    views = jax.tree.map(view, per_replica, layout_tree, by_stage)
    shards = jax.shard_map(
        scatter_all,
        in_specs=(jax.tree.map(in_spec, layout_tree, by_stage),),
        out_specs=_specs(layout_tree),
        check_vma=False,
    )(views)
    return jax.tree.map(lambda x, lay: lay.unview(x), shards, layout_tree)


def _owned_pair(a, b, owners, lay, keys):
    """{key: its ZeRO shard} of two leaves split over ('stage', *replicas) (`lay`), a and b
    this stage's shares, each zero but on its owner's stage (owners: two different stages):

        stage s:   x = a on owners[0], b elsewhere (b on owners[1], zeros on the rest)
        over the replicas: x viewed (S, R) along the split, reduce-scattered on R: 1 / R of x
        over 'stage': [x on owners[0], x on owners[1]] reduce-scattered on S: the two shards

    One leaf's bytes cross the replicas instead of both leaves' (each a reduce-scatter over
    ('stage', *replicas) of the whole table, the other stages' zeros included: the Llama 3
    405B's last 2.1 GB a GPU after its loop), and 2 / R of them the stages: the same sums
    landing on the same shards as `reduce_scatter`'s (stage-major, as the axes are listed)."""
    stage = jax.lax.axis_index(STAGE_AXIS)
    d = lay.dim + 1  # the view's (stage x replicas) axis
    x = jnp.where(stage == owners[0], a, b)
    x = x.reshape(*x.shape[:d], jax.lax.axis_size(STAGE_AXIS), -1, *x.shape[d + 1 :])
    x = jax.lax.psum_scatter(x, entry(lay.axes[1:]), scatter_dimension=d + 1, tiled=True)
    both = jnp.stack([jnp.where(stage == owner, x, jnp.zeros_like(x)) for owner in owners])
    both = jax.lax.psum_scatter(both, STAGE_AXIS, scatter_dimension=d + 1, tiled=True)
    shape = (*x.shape[:d], 1, *x.shape[d + 2 :])
    return {key: both[i].reshape(shape) for i, key in enumerate(keys)}
