"""Text in, text out, with Hugging Face's generation options: what launch/generate.py and the
lm-evaluation-harness adapter (harness.py) share on top of the token-level Generator.

    Settings(max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
             num_return_sequences, stop, seed)
    complete(generator, tokenizer, prompts, settings) -> per prompt, num_return_sequences
                                                         Completion(text, tokens)

As in Hugging Face's `generate`: greedy unless do_sample (then temperature, top_k and top_p
shape the distribution; top_k 0 and top_p 1 cut nothing); the repetition penalty applies
either way; each prompt is repeated num_return_sequences times in the batch. Stop strings: a
sequence ends at the first token after which its text contains one of them, and its text is
cut just before that string (lm-evaluation-harness's `until`, the OpenAI API's `stop`); its
tokens keep every token generated. A prompt and max_new_tokens beyond the model's context
window are an error (ValueError), never a silent cut.
"""

import dataclasses

from mtnlg_jax.eval.generation import Sampling


@dataclasses.dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    num_return_sequences: int = 1
    stop: tuple = ()
    seed: int = 0

    def sampling(self):
        if not self.do_sample:
            return Sampling(repetition_penalty=self.repetition_penalty)
        return Sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty)

    def check(self):
        """ValueError naming the setting that cannot work."""
        if self.max_new_tokens < 1:
            raise ValueError(
                f'max_new_tokens must be a positive integer, got {self.max_new_tokens}'
            )
        if self.num_return_sequences < 1:
            raise ValueError(
                f'num_return_sequences must be a positive integer, got {self.num_return_sequences}'
            )
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f'temperature must be > 0 with do_sample, got {self.temperature}')
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f'stop strings must be non-empty, got {list(self.stop)}')
        self.sampling().check()

    def check_fits(self, prompt_tokens, seq_len):
        """ValueError unless the longest prompt (token count) and max_new_tokens fit."""
        if prompt_tokens + self.max_new_tokens > seq_len:
            raise ValueError(
                f'max_new_tokens {self.max_new_tokens}: a prompt of {prompt_tokens} tokens leaves '
                f'room for {max(seq_len - prompt_tokens, 0)} new tokens in the context window '
                f'(seq_len={seq_len})'
            )

    def to_dict(self):
        return dict(dataclasses.asdict(self), stop=list(self.stop))


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    tokens: list


def cut_at_stop(text, stop):
    """`text` up to the earliest occurrence of any stop string; (text, whether cut)."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def complete(generator, tokenizer, prompts, settings, use_cache=True, on_tokens=None):
    """Completions of text `prompts`: a list per prompt of settings.num_return_sequences."""
    encoded = [tokenizer.encode_prompt(p) for p in prompts]  # Llama 3's: BOS first
    return complete_tokens(generator, tokenizer, encoded, settings, use_cache, on_tokens)


def complete_tokens(generator, tokenizer, encoded, settings, use_cache=True, on_tokens=None):
    """`complete` for prompts already tokenized (lists of ids)."""
    settings.check()
    if not all(encoded):
        raise ValueError('every prompt needs at least one token')
    settings.check_fits(max(map(len, encoded)), generator.cfg.seq_len)
    n = settings.num_return_sequences
    rows = [tokens for tokens in encoded for _ in range(n)]

    def should_stop(row, tokens):
        return cut_at_stop(tokenizer.decode(tokens), settings.stop)[1]

    outputs = generator(
        rows,
        settings.max_new_tokens,
        settings.sampling(),
        seed=settings.seed,
        eod_id=tokenizer.eod_id,
        use_cache=use_cache,
        on_tokens=on_tokens,
        should_stop=should_stop if settings.stop else None,
    )
    completions = [
        Completion(cut_at_stop(tokenizer.decode(tokens), settings.stop)[0], tokens)
        for tokens in outputs
    ]
    return [completions[i * n : (i + 1) * n] for i in range(len(encoded))]
