"""Tokenizers: a lossless sentencepiece model (below), GPT-2's BPE (gpt2_bpe.py) or a Hugging
Face tokenizer.json (HFTokenizer, below), by path.

`load(path)` opens what `data.tokenizer` names: a sentencepiece `.model` file, GPT-2 BPE
files (a directory holding vocab.json + merges.txt, or a path ending in vocab.json), or a
Hugging Face `tokenizer.json` (the file, or a directory holding it and no GPT-2 files, as
Llama 3's checkpoints ship it): Megatron's SentencePieceTokenizer, GPT2BPETokenizer and
HuggingFaceTokenizer. All have the same interface (vocab_size, eod_id, identity, encode,
encode_document, decode, export).

The sentencepiece tokenizer, for prose and code.

Why these trainer settings: the default corpus mixes the King James Bible
with Python source, so the tokenizer must reproduce newlines, indentation,
tabs and runs of spaces exactly (``decode(encode(text)) == text``):

* ``normalization_rule_name='identity'``, ``remove_extra_whitespaces=False``
  and ``add_dummy_prefix=False`` stop sentencepiece from rewriting the text
  (NFKC, collapsing spaces, inventing a leading space);
* ``'\\n'`` is a user-defined symbol, so a newline is always its own token
  even though the trainer only ever sees single lines;
* ``allow_whitespace_only_pieces=True`` lets indentation become single tokens
  ("▁▁▁▁", "▁▁▁▁▁▁▁▁");
* ``byte_fallback=True`` encodes any character outside the vocabulary as its
  UTF-8 bytes instead of ``<unk>``, so nothing is lost;
* ``split_digits=True`` keeps numbers compositional.

Ids: 0 is ``<unk>`` (never produced thanks to byte fallback), 1 is ``</s>``,
used as the end-of-document (eod) token; there is no bos or pad token.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Iterable, Iterator, Sequence

import sentencepiece as spm

from mtnlg_jax.data import gpt2_bpe
from mtnlg_jax.data.tokenizer_error import TokenizerError

EOD_ID = 1
_MODEL_TYPES = ("bpe", "unigram")
# Lines longer than this (in bytes) are skipped by the trainer only; they are
# still tokenized losslessly.
_MAX_TRAIN_LINE_BYTES = 16384
# Upper bound on the lines the trainer reads (it samples beyond that), which
# bounds training time and memory on larger corpora.  The default corpus has
# about 125k non-empty lines and trains in about a second.
_MAX_TRAIN_LINES = 1_000_000


__all__ = [
    'KINDS', 'HFTokenizer', 'Tokenizer', 'TokenizerError', 'from_files', 'load', 'open_tokenizer'
]  # fmt: skip
# Megatron's --tokenizer-type names
KINDS = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
HF_FILE = "tokenizer.json"


def load(path: str):
    """The tokenizer `path` names (see above); TokenizerError naming the file if unusable."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_FILE)):
        vocab, merges = gpt2_bpe.files_of(path)
        if not (os.path.isfile(vocab) and os.path.isfile(merges)):
            return HFTokenizer(os.path.join(path, HF_FILE))
    gpt2_files = gpt2_bpe.files_of(path)
    if gpt2_files is not None:
        return gpt2_bpe.GPT2BPETokenizer(*gpt2_files)
    if not os.path.isfile(path):
        raise TokenizerError(
            f"{path}: no such tokenizer (a sentencepiece .model, a Hugging Face tokenizer.json, "
            "or a directory or *vocab.json of GPT-2 BPE files)"
        )
    if path.endswith(".json"):
        return HFTokenizer(path)
    return Tokenizer(path)


def open_tokenizer(path, model_cfg, name='--tokenizer'):
    """The run's tokenizer (any kind `load` opens), checked
    to match the model's vocabulary (ids the model produces must decode, ids the tokenizer
    produces must embed); `name` says where the path came from in the error (a flag, or the
    config key training checks it under)."""
    if not path:
        raise TokenizerError(f'{name}: the run has no tokenizer (data.tokenizer is empty)')
    if not os.path.exists(path):
        raise TokenizerError(f'{name} {path}: no such file')
    try:
        tokenizer = load(path)
    except TokenizerError as e:
        raise TokenizerError(f'{name} {e}') from None
    except Exception as e:  # not a sentencepiece model, or unreadable BPE files
        raise TokenizerError(f'{name} {path}: not a usable tokenizer ({e})') from None
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise TokenizerError(
            f'{name} {path} ({tokenizer.kind}) has {tokenizer.vocab_size} pieces, but the '
            f"model's vocabulary (model.vocab_size) is {model_cfg.vocab_size}"
        )
    return tokenizer


def from_files(kind: str, files: Sequence[str]):
    """The tokenizer of `kind` (KINDS) made of `files` (its .files): how worker processes
    reopen one."""
    if kind == gpt2_bpe.KIND:
        return gpt2_bpe.GPT2BPETokenizer(*files)
    if kind == HFTokenizer.kind:
        return HFTokenizer(*files)
    return Tokenizer(*files)


class Tokenizer:
    """A trained sentencepiece model loaded from ``model_path`` (Megatron's
    SentencePieceTokenizer)."""

    kind = "SentencePieceTokenizer"

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise TokenizerError(f"{model_path}: no such tokenizer model")
        self.model_path = model_path
        self.files = (model_path,)
        with open(model_path, "rb") as fh:
            blob = fh.read()
        self._identity = hashlib.sha256(blob).hexdigest()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=blob)
        except RuntimeError as exc:  # not a serialized sentencepiece model
            raise TokenizerError(f"{model_path}: not a sentencepiece model ({exc})") from None
        if self._sp.eos_id() != EOD_ID:
            raise TokenizerError(f"{model_path}: eod id is {self._sp.eos_id()}, expected {EOD_ID}")

    @classmethod
    def train(
        cls,
        documents: Iterable[str],
        model_path_prefix: str,
        vocab_size: int,
        model_type: str = "bpe",
        seed: int = 0,
        num_threads: int = 2,
    ) -> "Tokenizer":
        """Train on ``documents``; write ``<model_path_prefix>.model`` and ``.vocab``.

        The trainer works on "sentences", so each document is fed as its
        non-blank lines; newlines themselves are the ``'\\n'`` user symbol.
        Deterministic for a given corpus, vocab size, model type and seed.
        """
        if model_type not in _MODEL_TYPES:
            raise TokenizerError(f"model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
        if vocab_size < 260:  # 256 byte pieces + <unk>, </s>, '\n' + at least one more
            raise TokenizerError(f"vocab_size must be at least 260, got {vocab_size}")
        directory = os.path.dirname(model_path_prefix)
        if directory:
            os.makedirs(directory, exist_ok=True)
        spm.set_random_generator_seed(seed)
        # Train into memory: with model_prefix the output path would be stored
        # in the model and change its identity from one directory to the next.
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_lines(documents),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                byte_fallback=True,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                normalization_rule_name="identity",
                user_defined_symbols=["\n"],
                unk_id=0,
                eos_id=EOD_ID,
                bos_id=-1,
                pad_id=-1,
                input_sentence_size=_MAX_TRAIN_LINES,
                shuffle_input_sentence=True,
                max_sentence_length=_MAX_TRAIN_LINE_BYTES,
                num_threads=num_threads,
                minloglevel=2,
            )
        except RuntimeError as exc:  # e.g. "Vocabulary size too high (..)"
            raise TokenizerError(f"sentencepiece training failed: {exc}") from exc
        model_path = model_path_prefix + ".model"
        tmp = f"{model_path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(model.getvalue())
        os.replace(tmp, model_path)
        tok = cls(model_path)
        with open(model_path_prefix + ".vocab", "w", encoding="utf-8") as fh:
            for i in range(tok.vocab_size):  # for people: JSON-quoted piece, tab, score
                piece = json.dumps(tok._sp.id_to_piece(i), ensure_ascii=False)
                fh.write(f"{piece}\t{tok._sp.get_score(i):g}\n")
        return tok

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        """End-of-document token id, appended by :meth:`encode_document`."""
        return EOD_ID

    @property
    def identity(self) -> str:
        """SHA-256 hex digest of the model file: what token files were made with."""
        return self._identity

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (lossless; no eod)."""
        return self._sp.encode(text)

    def encode_document(self, text: str) -> list[int]:
        """Token ids of one whole document followed by the eod token."""
        ids = self._sp.encode(text)
        ids.append(EOD_ID)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of ``text`` as the start of a document (no bos in this model)."""
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; eod tokens are dropped."""
        return self._sp.decode([int(i) for i in ids if int(i) != EOD_ID])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def export(self, directory: str, max_length: int) -> list[str]:
        """Write the model beside exported weights as tokenizer.model (Hugging Face's name for a
        sentencepiece file) with the tokenizer config transformers needs to encode as we do:
        LlamaTokenizer, no bos, no prefix space (`add_dummy_prefix=False` above), </s> as eos.
        AutoTokenizer then gives our ids (it converts the model: sentencepiece and protobuf
        installed)."""
        with open(os.path.join(directory, "tokenizer.model"), "wb") as fh:
            fh.write(self._sp.serialized_model_proto())
        special = dict(eos_token="</s>", unk_token="<unk>")
        config = dict(
            special,
            tokenizer_class="LlamaTokenizer",
            bos_token=None,
            add_bos_token=False,
            add_eos_token=False,
            add_prefix_space=False,
            legacy=True,
            clean_up_tokenization_spaces=False,
            model_max_length=max_length,
        )
        return ["tokenizer.model"] + _write_json_files(directory, config, special)


def _write_json_files(directory, tokenizer_config, special_tokens):
    """tokenizer_config.json and special_tokens_map.json; their names."""
    names = ["tokenizer_config.json", "special_tokens_map.json"]
    for name, content in zip(names, (tokenizer_config, special_tokens)):
        with open(os.path.join(directory, name), "w") as fh:
            json.dump(content, fh, indent=2)
    return names


class HFTokenizer:
    """A Hugging Face tokenizer.json (the `tokenizers` library; Megatron's
    HuggingFaceTokenizer), as Llama 3 ships its byte-level BPE.

    The end-of-document token is the eos_token of a tokenizer_config.json beside the file,
    else the first of EOD_NAMES the vocabulary holds. `encode` gives the text's ids alone
    (a continuation to score); `encode_prompt` runs the tokenizer's own post-processor
    (Llama 3's puts <|begin_of_text|> first) and `encode_document` appends the eod to that,
    as Megatron's preprocessing does with --append-eod, so each document, prompt and scored
    text starts with its BOS; `bos_id` is that token, or None."""

    kind = "HuggingFaceTokenizer"
    EOD_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")

    def __init__(self, path: str):
        import tokenizers

        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: no such tokenizer.json")
        self.model_path = path
        self.files = (path,)
        with open(path, "rb") as fh:
            self._identity = hashlib.sha256(fh.read()).hexdigest()
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own exception type
            raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from None
        self._config = _config_beside(path)
        names = [_token_text(self._config.get("eos_token"))] + list(self.EOD_NAMES)
        ids = [self._tok.token_to_id(n) for n in names if n]
        if not any(i is not None for i in ids):
            raise TokenizerError(f"{path}: no end-of-document token (any of {self.EOD_NAMES})")
        self._eod = next(i for i in ids if i is not None)
        with_specials = self._tok.encode("", add_special_tokens=True).ids
        self.bos_id = with_specials[0] if with_specials else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        return self._eod

    @property
    def identity(self) -> str:
        """SHA-256 of tokenizer.json: what token files were made with."""
        return self._identity

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> list[int]:
        return self.encode_prompt(text) + [self._eod]

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of `text` as the start of a document (a prompt, a text to score): after the
        tokenizer's own post-processor, so a Llama 3 prompt starts with its BOS as the
        documents it was trained on did."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens (eod, bos) are dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))

    def export(self, directory: str, max_length: int) -> list[str]:
        """tokenizer.json and the tokenizer config (the one beside the file when there is
        one, else PreTrainedTokenizerFast naming bos and eos) beside exported weights."""
        self._tok.save(os.path.join(directory, HF_FILE))
        special = dict(eos_token=self.id_to_piece(self._eod))
        if self.bos_id is not None:
            special["bos_token"] = self.id_to_piece(self.bos_id)
        config = self._config or dict(
            special, tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_length,
            clean_up_tokenization_spaces=False,
        )  # fmt: skip
        return [HF_FILE] + _write_json_files(directory, config, special)


def _config_beside(path):
    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    try:
        with open(config_path) as fh:
            config = json.load(fh)
        return config if isinstance(config, dict) else {}
    except (OSError, ValueError):
        return {}


def _token_text(token):
    """A tokenizer config's token: a string, or a dict with its 'content'."""
    return token.get("content") if isinstance(token, dict) else token


def _lines(documents: Iterable[str]) -> Iterator[str]:
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line
