"""The error both tokenizers raise (tokenizer.py's sentencepiece, gpt2_bpe.py's GPT-2 BPE).

Its own module so that the imports run one way: tokenizer.py (the loader) imports gpt2_bpe.py,
and both import this.
"""


class TokenizerError(ValueError):
    """Bad tokenizer arguments or a failed training run (message says which)."""
