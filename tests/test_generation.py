"""Generation: the KV-cache path decodes exactly what full recomputation decodes, on a
tensor-parallel mesh, for a batch of prompts of different lengths; sampling options and
stopping behave as documented."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import layout, small_config

from mtnlg_jax.eval.generation import Generator, Sampling, choose_tokens
from mtnlg_jax.model import gpt

PROMPTS = [[5, 17, 9], [800, 3, 3, 41, 7, 7, 120], [64]]


def generator(data, tensor):
    # A larger init than training's makes the logits peaked, so greedy choices are decided by
    # clear margins rather than by float rounding.
    config = small_config(data=data, tensor=tensor, init_std=0.3)
    mesh, setup = layout(config)
    with jax.set_mesh(mesh):
        params = jax.jit(
            lambda: gpt.split(gpt.create(config.model, config.train.seed))[1],
            out_shardings=setup.compute_shardings,
        )()
    return Generator(setup.graphdef, params, config.model, mesh), config


@pytest.fixture(scope='module')
def tensor_parallel():
    return generator(data=2, tensor=4)


def greedy_by_recomputation(generate, prompt, new_tokens):
    """The reference: one prompt at a time on one device, its whole sequence through the
    model at every step (padded to seq_len after the end: causal attention ignores that)."""
    model = gpt.merge(generate.graphdef, jax.device_get(generate.params))
    seq_len = generate.cfg.seq_len
    all_logits = jax.jit(lambda tokens: model.logits(model(tokens))[0])
    tokens = list(prompt)
    for _ in range(new_tokens):
        padded = jnp.asarray([tokens + [0] * (seq_len - len(tokens))])
        tokens.append(int(jnp.argmax(all_logits(padded)[len(tokens) - 1])))
    return tokens[len(prompt) :]


def test_greedy_with_the_kv_cache_equals_greedy_by_full_recomputation(tensor_parallel):
    generate, _ = tensor_parallel
    cached = generate(PROMPTS, max_new_tokens=12)
    recomputed = generate(PROMPTS, max_new_tokens=12, use_cache=False)
    reference = [greedy_by_recomputation(generate, prompt, 12) for prompt in PROMPTS]
    assert cached == recomputed == reference
    assert len({tuple(row) for row in cached}) == len(PROMPTS)  # not one degenerate answer


def test_generation_stops_at_end_of_document_and_at_the_sequence_length(tensor_parallel):
    generate, config = tensor_parallel
    free = generate(PROMPTS, max_new_tokens=6)
    # Row 1's first token that it had not produced before (and not first) ends its document.
    end = next(k for k in range(1, 6) if free[1][k] not in free[1][:k])
    eod = free[1][end]
    stopped = generate(PROMPTS, max_new_tokens=6, eod_id=eod)
    assert stopped[1] == free[1][: end + 1]
    for row in (0, 2):  # the others stop at their own first eod, if any, else run to the end
        expected = free[row][: free[row].index(eod) + 1] if eod in free[row] else free[row]
        assert stopped[row] == expected
    long = generate([[1] * (config.model.seq_len - 4)], max_new_tokens=100)
    assert len(long[0]) == 4


def test_tokens_are_streamed_as_they_are_chosen(tensor_parallel):
    generate, _ = tensor_parallel
    streamed = [[] for _ in PROMPTS]
    outputs = generate(PROMPTS, 5, on_tokens=lambda row, token: streamed[row].append(token))
    assert streamed == outputs


def test_sampling_is_reproducible_by_seed(tensor_parallel):
    generate, _ = tensor_parallel
    hot = Sampling(temperature=1.5, top_k=50, top_p=0.95)
    first = generate(PROMPTS, 8, hot, seed=1)
    assert generate(PROMPTS, 8, hot, seed=1) == first
    assert generate(PROMPTS, 8, hot, seed=2) != first


def test_top_k_and_top_p_sample_only_from_the_kept_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.key(0)
    top_k = choose_tokens(logits, keys, Sampling(temperature=1.0, top_k=2))
    assert set(np.asarray(top_k).tolist()) == {0, 1}
    top_p = choose_tokens(logits, keys, Sampling(temperature=1.0, top_p=0.9))
    assert set(np.asarray(top_p).tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.9 <= 0.95
    everything = choose_tokens(logits, keys, Sampling(temperature=1.0))
    assert set(np.asarray(everything).tolist()) == {0, 1, 2, 3}
    for greedy in (Sampling(temperature=3.0, top_k=1), Sampling(temperature=3.0, top_p=1e-6)):
        assert set(np.asarray(choose_tokens(logits, keys, greedy)).tolist()) == {0}
