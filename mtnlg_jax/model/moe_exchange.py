"""Expert parallelism's token exchange: the (token, choice) rows to their experts' ranks and
back, inside the train step's region manual over 'expert' (and, folded, over the tensor axis).

Two ways (`model.moe.exchange`), the same rows multiplied by the same experts:

    padded   every expert a buffer of C rows (capacity: its slots in these sequences;
             dropless: every row, as a token chooses an expert once), one all_to_all of
             experts x C rows each way: fixed sizes, so dropless carries (and multiplies)
             experts / top_k times the chosen rows
    ragged   only the chosen rows: the rows sorted by expert, each rank's slice sent with
             jax.lax.ragged_all_to_all at the offsets an all_gather of the send sizes gives,
             the received rows regrouped by local expert for the grouped matmul, and the
             same collective back

               rank q's send buffer   [ to rank 0: e0 e0 e1 | to rank 1: e2 e3 e3 | ... ]
               rank r's receive       [ from 0: its e_r rows | from 1: ... | ... | unused ]

             The receive buffer has room for the most a rank can get (every source's rows
             for min(local experts, top_k) of each token), never more than padded's; the
             wire and the grouped kernel (which skips empty tiles) carry the chosen rows.
             XLA:CPU has no ragged-all-to-all (UNIMPLEMENTED), so on the CPU `ragged_all_to_all`
             runs the same offsets through a padded all_to_all: the tests check the
             arithmetic, the XLA:GPU compile the collective.

Folded (model.moe.fold_tensor), each tensor rank sends its share of every expert's rows
(share = (index, pieces)): padded, slots index x C/p .. (index + 1) x C/p of each expert's C;
ragged, the index-th ceil(n_e / p) of expert e's n_e rows. The tokens' sums are then the
shares' sum over tensor (`folded`).
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mtnlg_jax.parallel.rules import EXPERT_AXIS, FOLDED_AXES, TENSOR_AXIS, shards

EXCHANGES = ('padded', 'ragged')


def exchange(moe, x, chosen, weights, keep, kernels=None, share=(0, 1)):
    """The routed experts' output (batch, seq, embed) of this rank's rows x (batch, seq,
    embed), their choices, weights and kept flags (batch, seq, top_k), the experts this
    rank's (experts / ranks of them, `kernels` in the compute dtype; default the module's)."""
    index, pieces = share
    route = Route(moe, chosen, keep, index, pieces)
    way = ragged if moe.exchange_kind == 'ragged' else padded
    return way(moe, x, route, weights, kernels)


class Route:
    """The rows sorted by expert (dropped last) and this share's part of each expert's rows."""

    def __init__(self, moe, chosen, keep, index, pieces):
        b, s, k = chosen.shape
        experts = moe.experts
        self.pieces, self.index = pieces, index
        self.axes = FOLDED_AXES if pieces > 1 else EXPERT_AXIS
        self.ranks = shards('folded_experts' if pieces > 1 else 'experts')
        self.local = experts // self.ranks
        ids = jnp.where(keep, chosen, experts).reshape(-1)
        self.order = checkpoint_name(jnp.argsort(ids, stable=True), 'moe_route')
        self.sizes = jnp.bincount(ids, length=experts + 1)[:-1]  # each expert's rows
        self.sorted = ids[self.order]
        starts = jnp.cumsum(self.sizes) - self.sizes
        expert = jnp.minimum(self.sorted, experts - 1)
        self.place = jnp.arange(ids.size) - starts[expert]  # within its expert's rows
        self.expert, self.shape = expert, (b, s, k)
        # the most rows of one expert from one rank: capacity's slots (of the whole
        # sequences, where context is manual), or every token
        per_expert = b * (moe.held_slots(s) if moe.capacity_factor else s)
        self.capacity = -(-per_expert // pieces)


def padded(moe, x, route, weights, kernels):
    """The exchange in buffers of route.capacity rows an expert (the module docstring)."""
    experts, capacity, ranks = moe.experts, route.capacity, route.ranks
    embed = x.shape[-1]
    place = route.place - route.index * capacity  # in its share
    mine = (route.sorted < experts) & (place >= 0) & (place < capacity)
    slot = jnp.where(mine, route.sorted * capacity + place, experts * capacity)
    buffers = Buffers(route.order, slot, weights, route.shape, experts * capacity, route.pieces > 1)
    local = route.local
    buffer = buffers.fill(x).reshape(ranks, local * capacity, embed)
    received = exchanged(jax.lax.all_to_all(buffer, route.axes, 0, 0), route.pieces)
    received = received.reshape(ranks, local, capacity, embed).transpose(1, 0, 2, 3)
    out = moe.expert_mlp(
        received.reshape(local, ranks * capacity, embed),
        lambda a, w: jnp.einsum('xne,xef->xnf', a, w),
        kernels,
        route.axes,
    )
    out = out.reshape(local, ranks, capacity, embed).transpose(1, 0, 2, 3)
    out = jax.lax.all_to_all(out.reshape(ranks, local * capacity, embed), route.axes, 0, 0)
    out = exchanged(out, route.pieces)
    return buffers.combine(out.reshape(experts * capacity, embed))


def ragged(moe, x, route, weights, kernels):
    """The exchange of the chosen rows alone (the module docstring)."""
    experts, ranks, local, pieces = moe.experts, route.ranks, route.local, route.pieces
    rows = route.order.size
    share = -(-route.sizes // pieces)
    low = route.index * share
    high = jnp.minimum(route.sizes, low + share)
    e = route.expert
    mine = (route.sorted < experts) & (route.place >= low[e]) & (route.place < high[e])
    size = rows if pieces == 1 else min(rows, -(-rows // pieces) + experts)
    slot = jnp.where(mine, jnp.cumsum(mine) - 1, size)  # packed in expert order
    buffers = Buffers(route.order, slot, weights, route.shape, size, pieces > 1)
    counts = jnp.maximum(high - low, 0).reshape(ranks, local).astype(jnp.int32)
    sends = Sizes(counts.sum(1), route.axes)
    received = jax.lax.all_to_all(counts, route.axes, 0, 0)  # (source, my local experts)
    width = min(size, local * route.capacity)  # the most one rank sends another
    recv_size = ranks * min(width, min(local, moe.top_k) * route.capacity)
    gathered = ragged_all_to_all(
        buffers.fill(x), recv_size, sends.there(), received.sum(1), route.axes, width, moe
    )
    gathered = exchanged(gathered, pieces)
    # regroup by local expert: the rows arrive (source, local expert) by (source, expert)
    segment = jnp.tile(jnp.arange(local), ranks)
    expert = jnp.repeat(segment, received.reshape(-1), total_repeat_length=recv_size)
    expert = jnp.where(jnp.arange(recv_size) < received.sum(), expert, local)
    regroup = jnp.argsort(expert, stable=True)
    out = moe.grouped_mlp(gathered[regroup], received.sum(0), kernels, route.axes)
    out = jnp.zeros_like(out).at[regroup].set(out)
    back = ragged_all_to_all(out, size, sends.back(), sends.sizes, route.axes, width, moe)
    return buffers.combine(exchanged(back, pieces))


class Sizes:
    """This rank's send sizes (ranks,) and where its rows sit on either side: `there()` the
    (input offsets, send sizes, output offsets) of the way out, `back()` those of the way
    back (each rank returns the rows it got from q to where q sent them from)."""

    def __init__(self, sizes, axes):
        self.sizes, self.axes = sizes, axes
        self.table = jax.lax.all_gather(sizes, axes)  # (source, destination)
        self.me = jax.lax.axis_index(axes)

    def there(self):
        starts = jnp.cumsum(self.sizes) - self.sizes
        below = (jnp.cumsum(self.table, 0) - self.table)[self.me]  # sources ahead of me
        return starts, self.sizes, below

    def back(self):
        received = self.table[:, self.me]
        starts = jnp.cumsum(received) - received
        origin = (jnp.cumsum(self.table, 1) - self.table)[:, self.me]  # in the sources' sends
        return starts, received, origin


def ragged_all_to_all(operand, size, offsets, recv_sizes, axes, width, moe):
    """(size, embed): the rows each rank sent here, at the offsets their senders chose, zero
    elsewhere. offsets: (input offsets, send sizes, output offsets), each (ranks,). width: the
    most rows one rank sends another (the CPU's padded pieces)."""
    starts, sends, there = offsets
    output = jnp.zeros((size, operand.shape[-1]), operand.dtype)
    if moe.native_ragged:
        return jax.lax.ragged_all_to_all(
            operand, output, starts, sends, there, recv_sizes, axis_name=axes
        )
    step = jnp.arange(width)
    pieces = operand.at[starts[:, None] + step].get(mode='fill', fill_value=0)
    pieces = jnp.where((step < sends[:, None])[..., None], pieces, 0)  # (ranks, width, embed)
    got = jax.lax.all_to_all(pieces, axes, 0, 0)
    where = jax.lax.all_to_all(there[:, None], axes, 0, 0)[:, 0]  # each source's offset here
    rows = jnp.where(step < recv_sizes[:, None], where[:, None] + step, size)
    return output.at[rows.reshape(-1)].set(got.reshape(-1, got.shape[-1]), mode='drop')


def folded(moe, x, chosen, weights, keep):
    """exchange's output under parallel folding (model.moe.fold_tensor), in a region manual
    over tensor within the replicas' over 'expert': each tensor rank gathers the sequences
    (its own 1/t of them is x's, along residual_seq), sends its share of every expert's rows
    over expert x tensor to the ranks of whole experts, and the tokens' sums are
    reduce-scattered back onto the sequence's 1/t slices (without sequence parallelism XLA
    gathers them whole after). No tensor all-reduce in the experts: each holds its expert
    whole."""
    kernels = moe.kernels()
    split = jax.sharding.PartitionSpec(None, TENSOR_AXIS, None)
    whole, mine = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(TENSOR_AXIS)

    def body(x, chosen, weights, keep, *kernels):
        x = jax.lax.all_gather(x, TENSOR_AXIS, axis=1, tiled=True)
        share = (jax.lax.axis_index(TENSOR_AXIS), jax.lax.axis_size(TENSOR_AXIS))
        out = exchange(moe, x, chosen, weights, keep, kernels, share)
        return jax.lax.psum_scatter(out, TENSOR_AXIS, scatter_dimension=1, tiled=True)

    return jax.shard_map(
        body,
        in_specs=(split, whole, whole, whole, *(mine,) * len(kernels)),
        out_specs=split,
        axis_names={TENSOR_AXIS},
        check_vma=False,
    )(x, chosen, weights, keep, *kernels)


class Buffers:
    """The exchange's buffers of `size` slots and the tokens' rows: `fill` puts each slot's
    row in, `combine` sums each token's k weighted rows out of them. By slot (`by_slot`,
    folded): each slot's token and weight, so that only the buffers' rows are gathered and
    scattered, never (b s k, embed) on every tensor rank. By row (unfolded): the (token,
    choice) rows in sort order scattered in and gathered back; there XLA sums the tensor-
    split experts' outputs on the buffers alone (by slot it added a (b, s, h) sum a layer
    pass: docs/benchmarks.md, "Mixtral 8x22B on 256 H100s")."""

    def __init__(self, order, slot, weights, shape, size, by_slot):
        self.order, self.slot, self.weights, self.shape = order, slot, weights, shape
        self.size, self.by_slot = size, by_slot
        b, s, k = shape
        if by_slot:  # b s past the last: an empty slot
            self.token = jnp.full((size,), b * s).at[slot].set(order // k, mode='drop')
            weight = jnp.zeros((size,), weights.dtype)
            self.weight = weight.at[slot].set(weights.reshape(-1)[order], mode='drop')

    def fill(self, x):
        """(size, embed) of x (b, s, embed): each slot's row, 0 where empty."""
        b, s, k = self.shape
        rows = x.reshape(b * s, x.shape[-1])
        if self.by_slot:
            return rows.at[self.token].get(mode='fill', fill_value=0)
        empty = jnp.zeros((self.size, x.shape[-1]), x.dtype)
        return empty.at[self.slot].set(rows[self.order // k], mode='drop')

    def combine(self, out):
        """(b, s, embed): each token's rows of out (size, embed), weighted and summed."""
        b, s, k = self.shape
        if self.by_slot:
            out = out * self.weight[:, None].astype(out.dtype)
            out = jnp.zeros((b * s, out.shape[-1]), out.dtype).at[self.token].add(out, mode='drop')
            return out.reshape(b, s, -1)
        out = out.at[self.slot].get(mode='fill', fill_value=0)
        back = jnp.zeros_like(self.order).at[self.order].set(jnp.arange(self.order.size))
        out = out[back].reshape(b, s, k, -1)  # back in token order: back is order's inverse
        return jnp.einsum('bske,bsk->bse', out, self.weights.astype(out.dtype))


def exchanged(rows, pieces):
    """An all-to-all's rows, named for selective recompute when folded (pieces > 1: 1/t of
    the unfolded exchange's rows a rank, cheap to keep); unfolded, recomputed."""
    return checkpoint_name(rows, 'moe_exchanged') if pieces > 1 else rows
