"""Teacher-forced scoring of token rows: the one model call every evaluation task makes.

A row is (tokens, mask): tokens t_0 .. t_n and a mask over the n targets t_1 .. t_n. For each
row the scorer returns the summed log-probability of the masked targets, whether every masked
target was the model's argmax (LAMBADA's strict rule), and the masked count. Perplexity,
LAMBADA and multiple choice differ only in the rows they build (see tasks.py), so the tasks
can be tested against any function with the scorer's signature.

On device the log-probabilities and the argmax test are reductions over the vocabulary
shards, as the training cross-entropy: no device gathers the full logits. Rows are padded to
a length bucket (a multiple of 64, at most seq_len + 1) so a whole evaluation compiles a
handful of shapes, and batches to a multiple of the mesh's data size.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import rules

LENGTH_BUCKET = 64


def continuation_row(context, continuation, seq_len):
    """The row scoring `continuation` after `context` (token id lists): cut from the left to
    seq_len + 1 tokens; the mask covers the continuation's tokens only."""
    if not continuation:
        raise ValueError('an empty continuation has nothing to score')
    if len(continuation) > seq_len:
        raise ValueError(f'a continuation of {len(continuation)} tokens exceeds seq_len={seq_len}')
    tokens = np.asarray(list(context) + list(continuation), np.int32)[-(seq_len + 1) :]
    mask = np.zeros(len(tokens) - 1, bool)
    mask[-len(continuation) :] = True
    return tokens, mask


def token_scores(logits, labels):
    """Per-token log-probability of each label and whether it is the argmax, from
    vocabulary-sharded fp32 logits (batch, seq, vocab)."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    label_logit = jnp.sum(jnp.where(vocab_ids == labels[..., None], logits, 0.0), axis=-1)
    log_prob = label_logit - jax.nn.logsumexp(logits, axis=-1)
    return log_prob, label_logit >= jnp.max(logits, axis=-1)


class Scorer:
    """score(rows) -> (log_prob_sum, all_argmax, count) arrays, one entry per row."""

    def __init__(self, loaded, batch_size=8, progress=True):
        self.loaded = loaded
        data = loaded.mesh.shape['data']
        self.batch_size = -(-batch_size // data) * data
        self.seq_len = loaded.config.model.seq_len
        self.progress = progress
        self._sharding = NamedSharding(loaded.mesh, rules.logical_to_spec(('batch', 'seq')))
        # Replicated scores (a few numbers a row): every process reads them, also when the
        # mesh spans several processes.
        replicated = NamedSharding(loaded.mesh, jax.sharding.PartitionSpec())
        self._score = jax.jit(self._score_batch, out_shardings=replicated)

    def _score_batch(self, params, tokens, mask):
        model = gpt.merge(self.loaded.graphdef, params)
        logits = model.logits(model(tokens[:, :-1]))
        log_prob, is_argmax = token_scores(logits, tokens[:, 1:])
        return (
            jnp.sum(jnp.where(mask, log_prob, 0.0), axis=-1),
            jnp.all(is_argmax | ~mask, axis=-1),
            jnp.sum(mask, axis=-1),
        )

    def __call__(self, rows, description='scoring'):
        results = [np.zeros(len(rows), np.float64), np.zeros(len(rows), bool), np.zeros(len(rows))]
        batches = range(0, len(rows), self.batch_size)
        with jax.set_mesh(self.loaded.mesh):
            for start in tqdm(batches, desc=description, disable=not self.progress, unit='batch'):
                chunk = rows[start : start + self.batch_size]
                longest = max(len(tokens) for tokens, _ in chunk)
                width = min(-(-longest // LENGTH_BUCKET) * LENGTH_BUCKET, self.seq_len + 1)
                tokens = np.zeros((self.batch_size, width), np.int32)
                mask = np.zeros((self.batch_size, width - 1), bool)
                for i, (row_tokens, row_mask) in enumerate(chunk):
                    tokens[i, : len(row_tokens)] = row_tokens
                    mask[i, : len(row_mask)] = row_mask
                put = lambda x: jax.device_put(x, self._sharding)  # noqa: E731
                scores = jax.device_get(self._score(self.loaded.params, put(tokens), put(mask)))
                for result, score in zip(results, scores):
                    result[start : start + len(chunk)] = score[: len(chunk)]
        return tuple(results)
