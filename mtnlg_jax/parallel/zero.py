"""ZeRO-1's two collectives over the replicas (rules.REPLICA_AXES: 'data', named so below),
written out rather than left to the partitioner.

    fp32 master shard --cast--> compute-dtype shard --all-gather over data--> compute copy
    fp32 gradient sums of each replica --reduce-scatter over data--> fp32 gradient shard

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
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mtnlg_jax.parallel.rules import (
    REPLICA_AXES,
    STAGE_AXIS,
    STAGE_ZERO_AXES,
    ZERO_AXIS,
    constrain_spec,
    replicas,
)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One leaf's ZeRO spec and where its 'data' split is: dimension `dim` (None: none),
    viewed as (groups, data, rest) with `before` the mesh axes that split `groups`."""

    spec: tuple
    dim: int | None
    before: tuple = ()
    groups: int = 1
    data: int = 1
    axes: tuple = REPLICA_AXES  # the mesh axes of the split: ('stage', 'data') together too

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
            if axes == STAGE_ZERO_AXES:
                data = sizes[STAGE_AXIS] * replicas(sizes)
                return ShardLayout(spec, dim, data=data, axes=STAGE_ZERO_AXES)
            if REPLICA_AXES[0] in axes:  # the replica axes follow those that split `groups`
                before = axes[: axes.index(REPLICA_AXES[0])]
                groups = 1
                for axis in before:
                    groups *= sizes[axis]
                return ShardLayout(spec, dim, before, groups, replicas(sizes))
        return ShardLayout(spec, None)

    return jax.tree.map(layout, zero_shardings)


def psum(x):
    """Inside a region manual over the replica axes: the sum over replicas (XLA rejects a
    cross-device sum over mesh axes of size 1, so that case returns x)."""
    sizes = {axis: jax.lax.axis_size(axis) for axis in REPLICA_AXES}
    return x if replicas(sizes) == 1 else jax.lax.psum(x, ZERO_AXIS)


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


def reduce_scatter(per_replica, layout_tree, by_stage=None):
    """The fp32 sums over replicas on the ZeRO shards. per_replica: each leaf's gradient sums
    of every replica, stacked on a leading axis split over 'data' (D, *leaf shape); where
    `by_stage` (a tree of bools like layout_tree; None: nowhere) says so, each stage's own
    partial sums, stacked over 'stage' after it (D, S, *leaf shape)."""
    if by_stage is None:
        by_stage = jax.tree.map(lambda _: False, layout_tree)

    def scatter(x, lay, stacked):
        x = x[0][0] if stacked else x[0]  # this replica's (and stage's) own sums
        if lay.axes == STAGE_ZERO_AXES:
            if not stacked:  # whole on every stage: one stage's copy enters the sum
                x = jnp.where(jax.lax.axis_index(STAGE_AXIS) == 0, x, jnp.zeros_like(x))
            return jax.lax.psum_scatter(x, lay.axes, scatter_dimension=lay.dim + 1, tiled=True)
        if lay.dim is None:
            x = psum(x)
        elif lay.data > 1:
            x = jax.lax.psum_scatter(x, ZERO_AXIS, scatter_dimension=lay.dim + 1, tiled=True)
        # the stages' shares summed on the ZeRO shard: 1 / d of the bytes of a sum before it
        return jax.lax.psum(x, STAGE_AXIS) if stacked else x

    def view(x, lay, stacked):
        return lay.view(x, offset=2 if stacked else 1)

    def in_spec(lay, stacked):
        leading = (ZERO_AXIS, STAGE_AXIS) if stacked else (ZERO_AXIS,)
        return PartitionSpec(*leading, *lay.view_spec(with_data=False))

    views = jax.tree.map(view, per_replica, layout_tree, by_stage)
    shards = jax.shard_map(
        lambda views: jax.tree.map(scatter, views, layout_tree, by_stage),
        in_specs=(jax.tree.map(in_spec, layout_tree, by_stage),),
        out_specs=_specs(layout_tree),
        check_vma=False,
    )(views)
    return jax.tree.map(lambda x, lay: lay.unview(x), shards, layout_tree)
