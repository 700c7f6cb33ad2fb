"""Data: the default corpus, its tokenizer, and the loader the trainer reads.

``launch/prepare_data.py`` turns the corpus into ``train.npy`` / ``valid.npy``
token files; the trainer only uses :mod:`mtnlg_jax.data.loader`.
"""

from mtnlg_jax.data.loader import (
    DataError,
    TokenWindowLoader,
    read_token_file,
    token_dtype,
    write_token_file,
)
from mtnlg_jax.data.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "DataError",
    "TokenWindowLoader",
    "Tokenizer",
    "TokenizerError",
    "read_token_file",
    "token_dtype",
    "write_token_file",
]
