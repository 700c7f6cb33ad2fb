"""Sequence pieces (model.sequence_pieces): a block's norms and projections on n pieces of
each sequence, so that one piece's tensor-parallel all-gather and reduce-scatter overlap
another piece's matmuls (docs/gpu.md, "Sequence pieces").

    residual stream, sequence shards of tensor ranks 0 .. t-1, n = 2:
        rank 0: [a0 b0]  rank 1: [a1 b1]  ...     piece a = a0 a1 ..., piece b = b0 b1 ...

Piece i is the i-th n-th of every shard, so cutting the stream into pieces and joining them
moves nothing between devices.
"""

import jax.numpy as jnp

from mtnlg_jax.parallel.rules import constrain, shards


def split(x, n, axes):
    """x (batch, seq, ...) laid out by the logical `axes` as n pieces (batch, seq / n, ...):
    piece i holds the i-th n-th of each of the residual stream's sequence shards (one under
    no sequence parallelism), so that a piece of the residual stream is split over the same
    ranks as the stream and nothing moves (model.sequence_pieces). Whole sequences (q, k, v,
    the context) are cut the same way, so that their pieces line up with the stream's."""
    if n == 1:
        return [x]
    t = shards('residual_seq', manual=False)
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    y = constrain(x.reshape(b, t, n, s // (t * n), *rest), _pieces_axes(axes))
    return [y[:, :, i].reshape(b, s // n, *rest) for i in range(n)]


def join(pieces, axes):
    """split()'s inverse: the pieces back in sequence order, laid out by `axes`."""
    if len(pieces) == 1:
        return pieces[0]
    t = shards('residual_seq', manual=False)
    b, s, rest = pieces[0].shape[0], pieces[0].shape[1], pieces[0].shape[2:]
    y = jnp.stack([p.reshape(b, t, s // t, *rest) for p in pieces], axis=2)
    y = constrain(y, _pieces_axes(axes))
    return constrain(y.reshape(b, s * len(pieces), *rest), axes)


def _pieces_axes(axes):
    """Logical names of (batch, shards, pieces, rows of a piece's shard, ...)."""
    return (axes[0], axes[1], None, None, *axes[2:])
