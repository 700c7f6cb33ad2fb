"""Generation: the KV-cache path decodes exactly what full recomputation decodes, on a
tensor-parallel mesh, for a batch of prompts of different lengths; sampling options and
stopping behave as documented."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import LLAMA_BLOCK, VOCAB, layout, small_config

from mtnlg_jax import config as config_lib

from mtnlg_jax.eval import completion
from mtnlg_jax.eval.generation import Generator, Sampling, choose_tokens
from mtnlg_jax.model import decode, gpt
from mtnlg_jax.model.layers import attention_dims
from mtnlg_jax.plan import hlo

PROMPTS = [[5, 17, 9], [800, 3, 3, 41, 7, 7, 120], [64]]


def generator(data, tensor, context=1, **model):
    # A larger init than training's makes the logits peaked, so greedy choices are decided by
    # clear margins rather than by float rounding.
    config = small_config(data=data, tensor=tensor, init_std=0.3, **model)
    if context > 1:
        config = config_lib.inputs_of(config)
        config.mesh.context = context
        config = config_lib.resolve(config, data * context * tensor)
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


def greedy_by_recomputation(generate, prompt, new_tokens, repetition_penalty=1.0):
    """The reference: one prompt at a time on one device, its whole sequence through the
    model at every step (padded to seq_len after the end: causal attention ignores that);
    the repetition penalty as Hugging Face's docs state it, in numpy."""
    model = gpt.merge(generate.graphdef, jax.device_get(generate.params))
    seq_len = generate.cfg.seq_len
    all_logits = jax.jit(lambda tokens: model.logits(model(tokens))[0])
    tokens = list(prompt)
    for _ in range(new_tokens):
        padded = jnp.asarray([tokens + [0] * (seq_len - len(tokens))])
        logits = np.array(all_logits(padded)[len(tokens) - 1])
        for seen in set(tokens):
            value = logits[seen]
            logits[seen] = value / repetition_penalty if value > 0 else value * repetition_penalty
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt) :]


def test_greedy_with_the_kv_cache_equals_greedy_by_full_recomputation(tensor_parallel):
    generate, _ = tensor_parallel
    cached = generate(PROMPTS, max_new_tokens=12)
    recomputed = generate(PROMPTS, max_new_tokens=12, use_cache=False)
    reference = [greedy_by_recomputation(generate, prompt, 12) for prompt in PROMPTS]
    bucketed = Generator(generate.graphdef, generate.params, generate.cfg, generate.mesh, 4)
    assert cached == recomputed == reference == bucketed(PROMPTS, max_new_tokens=12)
    assert len({tuple(row) for row in cached}) == len(PROMPTS)  # not one degenerate answer


@pytest.mark.parametrize('block', ['llama', 'gpt'])
def test_a_prompt_prefilled_over_context_decodes_as_one_device(block):
    """Llama's block (rope at the chunks' global positions, grouped heads) and GPT's (learned
    positions) on context 2 x tensor 2 x data 2: the prompts' prefill (the shortest one's
    first 16 tokens, 4 chunks of 4, rank r holding chunks r and 3 - r) is split over
    'context', the compiled prefill gathering each layer's keys and values over it; its cache
    is one device's prefill's and the greedy tokens those of full recomputation on one
    device."""
    model_keys = LLAMA_BLOCK if block == 'llama' else {}
    generate, config = generator(data=2, tensor=2, context=2, **model_keys)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (17, 20, 18, 19)]
    buffer = np.asarray([p[:16] for p in prompts], np.int32)
    with jax.set_mesh(generate.mesh):
        split = jax.device_get(generate._prefill_cache(buffer, 28))
        tokens = jax.device_put(buffer, generate._batch_sharding)
        compiled = Generator._prefill.lower(generate, generate.params, tokens, 28).compile()
    inventory = hlo.collective_inventory(compiled.as_text(), generate.mesh)
    gathers = [e for e in inventory if e['kind'] == 'all-gather' and e['axes'] == ('context',)]
    # K (or K and V together) whole over the prompt: 2 rows a data rank x 16 x the key/value
    # heads of a tensor rank x head_dim x 4 B
    _, kv_heads, head_dim = attention_dims(config.model)
    kv = 2 * 16 * kv_heads // 2 * head_dim * 4
    assert gathers and all(e['bytes'] in (kv, 2 * kv) for e in gathers), gathers
    assert all(e['in_loop'] and e['count'] == config.model.num_layers for e in gathers)
    model = gpt.merge(generate.graphdef, jax.device_get(generate.params))
    empty = decode.init_cache(generate.cfg, len(prompts), 28, jnp.float32)
    whole = jax.jit(lambda tokens: decode.forward_cached(model, tokens, empty, 0)[1])(buffer)
    for a, b in zip(split, whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    reference = [greedy_by_recomputation(generate, prompt, 8) for prompt in prompts]
    assert generate(prompts, max_new_tokens=8) == reference


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
    long = generate([[1] * (config.model.seq_len - 4)], max_new_tokens=4)
    assert len(long[0]) == 4
    with pytest.raises(ValueError, match='exceed the context window'):
        generate([[1] * (config.model.seq_len - 4)], max_new_tokens=5)  # no silent cut


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


class OneCharacterPerToken:
    """A stand-in tokenizer: token i is the character U+4E00 + i, so text and tokens align."""

    eod_id = VOCAB - 1

    def encode(self, text):
        return [ord(c) - 0x4E00 for c in text]

    encode_prompt = encode

    def decode(self, ids):
        return ''.join(chr(0x4E00 + i) for i in ids if i != self.eod_id)


def test_repetition_penalty_changes_greedy_output_as_specified(tensor_parallel):
    generate, _ = tensor_parallel
    free = generate(PROMPTS, 12)
    penalised = generate(PROMPTS, 12, Sampling(repetition_penalty=3.0))
    reference = [greedy_by_recomputation(generate, p, 12, repetition_penalty=3.0) for p in PROMPTS]
    assert penalised == reference and penalised != free
    assert all(len(set(row)) > len(set(f)) for row, f in zip(penalised, free) if len(set(f)) < 12)


def test_stop_strings_end_a_sequence_and_cut_its_text(tensor_parallel):
    generate, _ = tensor_parallel
    tokenizer, prompts = OneCharacterPerToken(), [OneCharacterPerToken().decode(p) for p in PROMPTS]
    free = completion.complete(generate, tokenizer, prompts, completion.Settings(max_new_tokens=10))
    text = free[1][0].text
    k = next(k for k in range(2, 10) if text[k] not in text[:k])  # a first occurrence
    stop = text[k - 1 : k + 1]  # two characters: completed by token k
    stopped = completion.complete(
        generate, tokenizer, prompts, completion.Settings(max_new_tokens=10, stop=('x', stop))
    )
    assert stopped[1][0].tokens == free[1][0].tokens[: k + 1]
    assert stopped[1][0].text == text[: k - 1]
    for row in (0, 2):
        expected, cut = completion.cut_at_stop(free[row][0].text, (stop,))
        assert stopped[row][0].text == expected
        if not cut:
            assert stopped[row][0].tokens == free[row][0].tokens


def test_num_return_sequences_and_sampling_settings(tensor_parallel):
    generate, config = tensor_parallel
    tokenizer, prompts = OneCharacterPerToken(), [OneCharacterPerToken().decode(p) for p in PROMPTS]
    hot = completion.Settings(max_new_tokens=6, do_sample=True, temperature=2.0,
                              num_return_sequences=3, seed=4)  # fmt: skip
    sampled = completion.complete(generate, tokenizer, prompts, hot)
    assert [len(sequences) for sequences in sampled] == [3, 3, 3]
    assert len({tuple(s.tokens) for s in sampled[1]}) > 1  # the copies sample independently
    assert completion.complete(generate, tokenizer, prompts, hot) == sampled
    greedy = completion.complete(
        generate, tokenizer, prompts, completion.Settings(max_new_tokens=6, num_return_sequences=2)
    )
    assert all(a == b for a, b in greedy)
    with pytest.raises(ValueError, match='room for 4 new tokens'):
        too_long = completion.Settings(max_new_tokens=5)
        completion.complete(
            generate, tokenizer, [tokenizer.decode([1] * (config.model.seq_len - 4))], too_long
        )
