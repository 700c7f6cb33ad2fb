"""The output layer and the cross-entropy as one function whose gradients come from its forward.

    hidden (batch, seq, embed)      scan over `loss_chunks` pieces of the sequence:
    token_embed E (vocab, embed)      logits = piece @ E^T            (batch, seq/c, vocab) fp32
                                      loss  += logsumexp - label's logit
                                      d logits = softmax - one-hot    (one pass, as exp runs)
                                      d piece  = d logits @ E         -> d hidden, piece by piece
                                      d E^T   += piece^T @ d logits   (carried, fp32)
    backward: cotangent x (d hidden, d E)

Autodiff of `logits -> cross_entropy` keeps the (tokens, vocab) fp32 logits for the backward
and then writes their gradient, another (tokens, vocab) array, a second time transposed for
the embedding's gradient (XLA:CPU's dot wants that layout): three passes over the largest
arrays of the step. Here one piece's logits live at a time, the backward keeps d hidden
(tokens, embed) and d E (vocab, embed) instead of the logits, and is two multiplications by
the incoming scalar (what it saves on the CPU step: docs/benchmarks.md). The same idea as
Megatron's fused
vocabulary-parallel cross-entropy and Liger-Kernel's fused linear cross-entropy.

The vocabulary may be split (`vocab` over tensor): logsumexp and the label's logit are
reductions over `vocab`, d hidden sums over it (one all-reduce per piece, an activation in
all, as Megatron's), d E stays on each device's own rows; no device holds the whole
vocabulary's logits.
"""

import functools

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel.rules import constrain, shards


def _pieces(x, chunks):
    """(batch, seq, ...) -> (chunks, batch, seq / chunks, ...): the pieces a scan walks.
    Under context parallelism (the sequence split over c ranks) piece i is the i-th of each
    rank's shard, so a piece is split over the ranks as the sequence is and nothing moves
    (the loss is a sum: the order of its tokens does not matter)."""
    batch, seq = x.shape[:2]
    context = shards('seq', manual=False)
    if context == 1:
        x = x.reshape(batch, chunks, seq // chunks, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)
    x = x.reshape(batch, context, chunks, seq // (context * chunks), *x.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(chunks, batch, seq // chunks, *x.shape[4:])


def _whole(x):
    """The inverse of _pieces."""
    context = shards('seq', manual=False)
    if context == 1:
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], -1, *x.shape[3:])
    chunks, batch, piece = x.shape[:3]
    x = x.reshape(chunks, batch, context, piece // context, *x.shape[3:])
    return jnp.moveaxis(x, 0, 2).reshape(batch, chunks * piece, *x.shape[4:])


def logits(hidden, embed, vocab_size):
    """fp32 logits (..., batch, seq, padded vocab) of hidden (..., batch, seq, embed), sharded
    over `vocab`; padding columns (past vocab_size) at -inf."""
    out = jnp.einsum('...e,ve->...v', hidden, embed, preferred_element_type=jnp.float32)
    out = constrain(out, ('batch', 'seq', 'vocab'))
    if vocab_size < embed.shape[0]:
        out = jnp.where(_vocab_ids(out) < vocab_size, out, -jnp.inf)
    return out


def _vocab_ids(logits):
    return jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)


def _is_label(logits, labels):
    return _vocab_ids(logits) == labels[..., None]


def _label_logit(logits, labels):
    """The label's logit as a masked sum over `vocab`: with `vocab` split, each device sums
    its own slice and one all-reduce of a number per token completes it (as Megatron's)."""
    return jnp.sum(jnp.where(_is_label(logits, labels), logits, 0.0), axis=-1)


def cross_entropy(logits, labels):
    """Per-token loss from vocab-sharded fp32 logits: only reductions over `vocab`, no gather
    of the logits, so each device keeps its own vocabulary slice. (Training's summed loss
    goes through head_loss_sum, which never keeps the logits.)"""
    return jax.nn.logsumexp(logits, axis=-1) - _label_logit(logits, labels)


def _chunk_loss(hidden, embed, labels, vocab_size, weights=None):
    """(logits, log-sum-exp, summed loss) of one piece; weights (batch, seq) or None."""
    piece_logits = logits(hidden, embed, vocab_size)
    lse = jax.nn.logsumexp(piece_logits, axis=-1)
    token_loss = lse - _label_logit(piece_logits, labels)
    if weights is not None:
        token_loss = token_loss * weights
    return piece_logits, lse, jnp.sum(token_loss)


def _pieces_of(hidden, labels, weights, chunks):
    """What the scans walk: (hidden, labels[, weights]) cut into `chunks` pieces."""
    pieces = (_pieces(hidden, chunks), _pieces(labels, chunks))
    return pieces if weights is None else pieces + (_pieces(weights, chunks),)


def head_loss_sum(hidden, embed, labels, vocab_size, chunks, weights=None):
    """Summed next-token cross-entropy of logits = hidden @ embed.T (fp32), over `chunks`
    pieces of the sequence (a divisor of its length) one after another. hidden (batch, seq,
    embed); embed (padded vocab, embed), rows past vocab_size are padding; labels (batch,
    seq) int; weights (batch, seq) fp32, each token's share (a loss mask), or None for 1."""
    if weights is None:
        return _head_loss_sum(hidden, embed, labels, vocab_size, chunks)
    return _weighted_head_loss_sum(hidden, embed, labels, weights, vocab_size, chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head_loss_sum(hidden, embed, labels, vocab_size, chunks):
    return _summed(hidden, embed, labels, None, vocab_size, chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _weighted_head_loss_sum(hidden, embed, labels, weights, vocab_size, chunks):
    return _summed(hidden, embed, labels, weights, vocab_size, chunks)


def _summed(hidden, embed, labels, weights, vocab_size, chunks):
    """The loss alone (no gradients): one piece's logits at a time."""
    hidden = constrain(hidden, ('batch', 'seq', 'embed'))

    def add_piece(total, piece):
        piece_hidden, piece_labels, *piece_weights = piece
        loss = _chunk_loss(piece_hidden, embed, piece_labels, vocab_size, *piece_weights)[2]
        return total + loss, None

    pieces = _pieces_of(hidden, labels, weights, chunks)
    total, _ = jax.lax.scan(add_piece, jnp.zeros((), jnp.float32), pieces)
    return total


def _forward_and_gradients(hidden, embed, labels, weights, vocab_size, chunks):
    """The loss and its gradients: d logits = softmax - one-hot, made in the one pass that
    exponentiates the logits; d hidden = d logits @ E (summed over `vocab`: an all-reduce
    when it is split); d E is summed, in the scan's carry, as its transpose (embed, vocab) =
    hidden^T @ d logits, whose operands XLA:CPU's dot takes as they lie (d logits^T @ hidden
    made it write the whole (vocab, tokens) d logits once more, transposed)."""
    hidden = constrain(hidden, ('batch', 'seq', 'embed'))

    def add_piece(carry, piece):
        total, d_embed_t = carry
        piece_hidden, piece_labels, *piece_weights = piece
        piece_hidden = constrain(piece_hidden, ('batch', 'seq', 'embed'))
        piece_logits, lse, loss = _chunk_loss(
            piece_hidden, embed, piece_labels, vocab_size, *piece_weights
        )
        probs = jnp.exp(piece_logits - lse[..., None])
        d_logits = jnp.where(_is_label(piece_logits, piece_labels), probs - 1.0, probs)
        if piece_weights:
            d_logits = d_logits * piece_weights[0][..., None]
        d_logits = constrain(d_logits.astype(hidden.dtype), ('batch', 'seq', 'vocab'))
        d_hidden = jnp.einsum('bsv,ve->bse', d_logits, embed)
        d_embed_t += jnp.einsum(
            'bse,bsv->ev', piece_hidden, d_logits, preferred_element_type=jnp.float32
        )
        d_embed_t = constrain(d_embed_t, ('embed', 'vocab'))
        return (total + loss, d_embed_t), constrain(d_hidden, ('batch', 'seq', 'embed'))

    d_embed_t = constrain(jnp.zeros(embed.shape[::-1], jnp.float32), ('embed', 'vocab'))
    init = (jnp.zeros((), jnp.float32), d_embed_t)
    pieces = _pieces_of(hidden, labels, weights, chunks)
    (total, d_embed_t), d_hidden = jax.lax.scan(add_piece, init, pieces)
    d_hidden = constrain(_whole(d_hidden), ('batch', 'seq', 'embed'))
    return total, (d_hidden, d_embed_t.astype(embed.dtype))


def _backward(vocab_size, chunks, saved, g):
    """The saved gradients times the loss's cotangent; d E turned back to (vocab, embed) in
    the same pass. Labels and weights get none."""
    d_hidden, d_embed_t = saved
    d_embed = constrain((g * d_embed_t).T.astype(d_embed_t.dtype), ('vocab', 'embed'))
    return (g * d_hidden).astype(d_hidden.dtype), d_embed


_head_loss_sum.defvjp(
    lambda hidden, embed, labels, vocab_size, chunks: _forward_and_gradients(
        hidden, embed, labels, None, vocab_size, chunks
    ),
    lambda vocab_size, chunks, saved, g: (*_backward(vocab_size, chunks, saved, g), None),
)
_weighted_head_loss_sum.defvjp(
    _forward_and_gradients,
    lambda vocab_size, chunks, saved, g: (*_backward(vocab_size, chunks, saved, g), None, None),
)
