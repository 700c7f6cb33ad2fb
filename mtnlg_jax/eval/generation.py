"""Text generation: a batch of prompts, greedy or sampled, with a KV cache, on the mesh.

    Generator(graphdef, params, model_cfg, mesh)(prompts, max_new_tokens, ...)

Prompts of different lengths share one position counter (as Meta's LLaMA reference code
does): the batch is prefilled up to the shortest prompt in one call, then advances one
position per call; a row still inside its prompt takes its next prompt token instead of the
sampled one. Every row thus sits at its true positions (the position embedding is learned and
absolute, so left padding would shift it) and no attention mask beyond causality is needed.

Sharding: the compute parameters keep the rule table's layout (heads, MLP and vocabulary split
over 'tensor'), the cache is split over heads, and the batch over 'data' (padded to a
multiple of it). Sampling runs on device; only the chosen token ids come back each step, so
the host can stream text as it is produced (and stop a row once its text holds a stop
string: completion.py). The repetition penalty keeps a (batch, vocab) mask of the tokens
each row has seen, split like the logits. `use_cache=False` recomputes the whole sequence at
every step: the reference the cached path is tested and benchmarked against.

Under context parallelism (mesh.context = c > 1) the prefill is split over 'context' as a
training sequence is (parallel/context.py): the prompt's first multiple of 2c tokens in the
chunk order, each rank's queries its two chunks against the keys and values gathered over
'context' (the flash kernel at each chunk's offset on a GPU, else the plain path), the cache
filled in sequence order; the tokens after it, one at a time, as without.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from mtnlg_jax.model import decode, gpt
from mtnlg_jax.parallel import context as context_lib
from mtnlg_jax.parallel import rules


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy. top_k 0 and top_p 1: no truncation of the distribution.
    repetition_penalty (CTRL's, as Hugging Face's): the logit of every token already in the
    sequence, prompt included, is divided by it when positive and multiplied when negative."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def check(self):
        if self.temperature < 0:
            raise ValueError(f'temperature must be >= 0, got {self.temperature}')
        if self.top_k < 0:
            raise ValueError(f'top_k must be >= 0, got {self.top_k}')
        if not 0 < self.top_p <= 1:
            raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')
        if not self.repetition_penalty > 0:
            raise ValueError(f'repetition_penalty must be > 0, got {self.repetition_penalty}')


def penalise_repetitions(logits, seen, penalty):
    """Logits (batch, vocab) with those of the `seen` tokens (batch, vocab) made less likely."""
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalised, logits)


def choose_tokens(logits, key, sampling, seen=None):
    """Next token ids (batch,) from fp32 logits (batch, vocab) under `sampling`; seen: the
    tokens (batch, vocab) of each sequence so far, for the repetition penalty."""
    if sampling.repetition_penalty != 1 and seen is not None:
        logits = penalise_repetitions(logits, seen, sampling.repetition_penalty)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if sampling.top_p < 1:
        # Keep the smallest set of most likely tokens whose probability reaches top_p.
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely ones
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """Generation from compute-dtype parameters laid out on `mesh` by the rule table."""

    def __init__(self, graphdef, params, model_cfg, mesh, shape_bucket=1):
        """shape_bucket: prefill and cache lengths are multiples of it (1: exact)."""
        self.graphdef, self.params, self.cfg, self.mesh = graphdef, params, model_cfg, mesh
        self.shape_bucket = shape_bucket
        self.dtype = jnp.dtype(model_cfg.compute_dtype)  # the cache's (buffers are fp32)
        self._batch_sharding = NamedSharding(mesh, rules.logical_to_spec(('batch',)))
        self._seen_sharding = NamedSharding(mesh, rules.logical_to_spec(('batch', 'vocab')))

    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def _empty_cache(self, rows, max_len):
        return decode.init_cache(self.cfg, rows, max_len, self.dtype)

    @property
    def context(self):
        """mesh.context: a prefill of a multiple of 2 x context tokens is split over it."""
        return self.mesh.shape.get(rules.CONTEXT_AXIS, 1)

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def _prefill(self, params, tokens, max_len):
        """The cache after tokens (batch, n), with room for max_len positions; under context
        parallelism the tokens in the chunk order, each rank's two chunks its own
        (decode.forward_cached)."""
        cache = decode.init_cache(self.cfg, tokens.shape[0], max_len, self.dtype)
        model, order = gpt.merge(self.graphdef, params), None
        if self.context > 1:
            order = context_lib.chunk_order(tokens.shape[1], self.context)
            tokens = tokens[:, order]
        return decode.forward_cached(model, tokens, cache, 0, order)[1]

    @staticmethod
    def _choose(logits, token, seen, index, sampling, key):
        """The token at `index` from the logits after `token` (at index - 1), which joins
        the tokens `seen` (batch, vocab) by each row."""
        seen = seen.at[jnp.arange(seen.shape[0]), token].set(True)
        return choose_tokens(logits, jax.random.fold_in(key, index), sampling, seen), seen

    @functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2, 4))
    def _cached_step(self, params, cache, token, seen, index, sampling, key):
        """`token` sits at position index - 1: the cache grows by it and its logits choose the
        token at `index`."""
        logits, cache = decode.forward_cached(
            gpt.merge(self.graphdef, params), token[:, None], cache, index - 1
        )
        return *self._choose(logits, token, seen, index, sampling, key), cache

    @functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(4,))
    def _full_step(self, params, tokens, token, seen, index, sampling, key):
        """Recompute the whole buffer; the token at `index` from the logits at index - 1."""
        model = gpt.merge(self.graphdef, params)
        hidden = jax.lax.dynamic_slice_in_dim(model(tokens), index - 1, 1, axis=1)
        logits = model.logits(hidden)[:, 0]
        return self._choose(logits, token, seen, index, sampling, key)

    def __call__(
        self,
        prompts,
        max_new_tokens,
        sampling=Sampling(),
        seed=0,
        eod_id=None,
        use_cache=True,
        on_tokens=None,
        should_stop=None,
    ):
        """The new tokens of each prompt (lists of ids), at most max_new_tokens each, ending
        at (and including) eod_id. on_tokens(row, token) is called as each token is chosen;
        a row also ends after a token for which should_stop(row, its new tokens) is true.
        ValueError if a prompt and max_new_tokens do not fit in seq_len (no silent cut)."""
        sampling.check()
        lengths = np.array([len(p) for p in prompts])
        if len(prompts) == 0 or lengths.min() == 0:
            raise ValueError('every prompt needs at least one token')
        if max_new_tokens < 1:
            raise ValueError(f'max_new_tokens must be at least 1, got {max_new_tokens}')
        if lengths.max() + max_new_tokens > self.cfg.seq_len:
            raise ValueError(
                f'a prompt of {lengths.max()} tokens and max_new_tokens={max_new_tokens} exceed '
                f'the context window (seq_len={self.cfg.seq_len})'
            )
        # With shape_bucket > 1 a stream of batches (lm-evaluation-harness's) compiles a few
        # shapes: the buffer and cache round up to it (rows still end at their own quota).
        bucket = self.shape_bucket
        total = min(-(-int(lengths.max() + max_new_tokens) // bucket) * bucket, self.cfg.seq_len)
        rows = -(-len(prompts) // self.mesh.shape['data']) * self.mesh.shape['data']
        buffer = np.zeros((rows, total), np.int32)
        for row, prompt in enumerate(prompts):
            buffer[row, : len(prompt)] = prompt
        lengths = np.concatenate([lengths, np.full(rows - len(prompts), lengths.min())])
        quota = np.minimum(lengths + max_new_tokens, total)  # position after a row's last token
        finished = quota <= lengths
        outputs = [[] for _ in prompts]
        key = jax.random.key(seed)
        # Prefill all but the last token of the shortest prompt (rounded down to the bucket);
        # the steps from there feed each row its own prompt tokens until it generates.
        # (Under context parallelism, to a multiple of 2 x context: the prefill's chunks.)
        chunks = math.lcm(bucket, 2 * self.context if self.context > 1 else 1)
        prefilled = (int(lengths.min()) - 1) // chunks * chunks
        seen = np.zeros((rows, self.cfg.padded_vocab), bool)  # the tokens prefilled
        seen[np.repeat(np.arange(rows), prefilled), buffer[:, :prefilled].reshape(-1)] = True

        with jax.set_mesh(self.mesh):
            put = functools.partial(jax.device_put, device=self._batch_sharding)
            seen = jax.device_put(seen, self._seen_sharding)
            if use_cache:
                # No logits are needed before the shortest prompt's last token: prefill (some
                # of) those positions, then feed the rest through the same step as every later
                # token.
                cache = self._prefill_cache(buffer[:, :prefilled], total)
            for index in range(prefilled + 1, total):
                token = put(buffer[:, index - 1])
                if use_cache:
                    chosen, seen, cache = self._cached_step(
                        self.params, cache, token, seen, index, sampling, key
                    )
                else:
                    chosen, seen = self._full_step(
                        self.params, put(buffer), token, seen, index, sampling, key
                    )
                if not chosen.is_fully_addressable:  # rows on other processes too
                    chosen = multihost_utils.process_allgather(chosen, tiled=True)
                chosen = np.asarray(chosen)
                generating = (index >= lengths) & ~finished
                buffer[generating, index] = chosen[generating]
                stopped = np.zeros(rows, bool)
                for row in np.flatnonzero(generating[: len(prompts)]):
                    outputs[row].append(int(chosen[row]))
                    if on_tokens is not None:
                        on_tokens(row, int(chosen[row]))
                    if should_stop is not None:
                        stopped[row] = should_stop(row, outputs[row])
                finished |= generating & ((chosen == eod_id) | (index + 1 >= quota) | stopped)
                if finished.all():
                    break
        return outputs

    def _prefill_cache(self, tokens, total):
        """The cache after `tokens` (batch, n >= 0), with room for `total` positions."""
        if tokens.shape[1] == 0:
            return self._empty_cache(tokens.shape[0], total)
        return self._prefill(self.params, jax.device_put(tokens, self._batch_sharding), total)
