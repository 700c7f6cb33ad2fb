"""Context parallelism: the chunk layout that splits each sequence over the `context` axis.

Each sequence is cut into 2 x c chunks (c = mesh.context); context rank r holds chunks r and
2c - 1 - r, so every rank holds one early and one late chunk and the causal work (a query sees
the keys before it) is the same on every rank. The train step puts a micro-batch's tokens,
labels, positions, segment ids and loss mask in this order (`order`), and the rule table
splits the sequence (`seq`, and the residual stream's `residual_seq`) over `context`, so a
rank's contiguous shard is its two chunks:

    seq = 16, c = 2: chunks of 4            natural order   0 ..  3 | 4 ..  7 | 8 .. 11 | 12 .. 15
                                                             chunk 0   chunk 1   chunk 2   chunk 3
    chunk order (order[i]: the global          rank 0: chunk 0 + chunk 3   rank 1: chunk 1 + chunk 2
    position of the token at place i)          0 1 2 3 12 13 14 15         4 5 6 7 8 9 10 11

Attention gathers the keys and values over `context` (an all-gather per layer, whose transpose
in the backward is a reduce-scatter of their gradients: Llama 3's choice) and each query sees
a key when the key's global position is not later and, with packed documents, its segment id
is the query's: the masks come from the global positions and segment ids that travel with
each chunk (model/attention.py), never from a token's place in the chunked order. Rope positions
and learned positions are the global ones too (or the packed documents' own, which are
permuted with their tokens). The loss and the token count are sums, which do not depend on the
order; the gradients of every parameter, replicated over `context`, are summed over it as
over `data`: the train step's region is manual over both (rules.region_axes), and ZeRO-1's
one reduce-scatter a step sums each rank's partial sums (parallel/zero.py).

At c = 1 the order is the identity and nothing is permuted: the step compiles as before.
"""

import numpy as np


def chunk_order(seq, context):
    """(seq,) int32: the global position of the token at each place of the chunked order
    (rank r's shard: chunks r and 2 x context - 1 - r); 0 .. seq - 1 for context 1."""
    if context == 1:
        return np.arange(seq, dtype=np.int32)
    chunks = 2 * context
    if seq % chunks:
        raise ValueError(f'a sequence of {seq} does not cut into {chunks} chunks')
    size = seq // chunks
    order = [(r, chunks - 1 - r) for r in range(context)]
    return np.concatenate(
        [np.arange(c * size, (c + 1) * size) for pair in order for c in pair]
    ).astype(np.int32)
