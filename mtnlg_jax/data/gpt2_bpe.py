"""GPT-2's byte-level BPE (Megatron's GPT2BPETokenizer) through Hugging Face's `tokenizers`.

The files are GPT-2's own: vocab.json (piece -> id, the pieces spelled in GPT-2's byte-to-
unicode alphabet) and merges.txt (the merge rules in rank order), as Megatron-LM's
`--vocab-file`/`--merge-file` and every Hugging Face GPT-2 directory hold them. Encoding is
GPT-2's: its pre-tokenising regex over the UTF-8 bytes of the text, no prefix space, so any
text round-trips exactly. `<|endoftext|>` is the end-of-document token (id 50256 in GPT-2's
50,257-piece vocabulary); as in Megatron, the string "<|endoftext|>" inside a text is plain
text, not the token.

`train` makes a byte-level BPE of any size on a corpus, in the same two files, with
`<|endoftext|>` as the last id as in GPT-2's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtnlg_jax.data.tokenizer_error import TokenizerError

EOD_TOKEN = '<|endoftext|>'
KIND = 'GPT2BPETokenizer'
# Names of the two files in a directory: Hugging Face's, then Megatron's download names.
FILE_NAMES = (('vocab.json', 'merges.txt'), ('gpt2-vocab.json', 'gpt2-merges.txt'))


class GPT2BPETokenizer:
    """GPT-2 BPE from `vocab_file` and `merge_file` (the same interface as the sentencepiece
    Tokenizer: vocab_size, eod_id, identity, encode, encode_document, decode)."""

    kind = KIND

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (('vocab file', vocab_file), ('merge file', merge_file)):
            if not os.path.isfile(path):
                raise TokenizerError(f'{path}: no such GPT-2 BPE {flag}')
        self.files = (vocab_file, merge_file)
        self.model_path = vocab_file
        digest = hashlib.sha256()
        for path in self.files:
            with open(path, 'rb') as f:
                digest.update(f.read())
            digest.update(b'\0')
        self._identity = digest.hexdigest()
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # tokenizers raises its own exception type for bad files
            raise TokenizerError(f'{vocab_file}, {merge_file}: not GPT-2 BPE files ({e})') from None
        self._tok = tokenizers.Tokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise TokenizerError(f'{vocab_file}: has no {EOD_TOKEN} piece (the eod token)')
        self._eod = eod

    @classmethod
    def train(
        cls,
        documents: Iterable[str],
        vocab_file: str,
        merge_file: str,
        vocab_size: int,
    ) -> 'GPT2BPETokenizer':
        """A byte-level BPE of `vocab_size` pieces (<|endoftext|> included, last) trained on
        `documents`, written to vocab_file and merge_file. Deterministic for a corpus."""
        if vocab_size < 258:  # the 256 bytes, <|endoftext|> and at least one merge
            raise TokenizerError(f'vocab_size must be at least 258, got {vocab_size}')
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - 1,
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(documents, trainer)
        with tempfile.TemporaryDirectory() as scratch:
            saved_vocab, saved_merges = tok.model.save(scratch)
            with open(saved_vocab, encoding='utf-8') as f:
                vocab = json.load(f)
            vocab[EOD_TOKEN] = len(vocab)
            for path in (vocab_file, merge_file):
                if os.path.dirname(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_atomically(vocab_file, json.dumps(vocab, ensure_ascii=False))
            with open(saved_merges, encoding='utf-8') as f:
                _write_atomically(merge_file, f.read())
        return cls(vocab_file, merge_file)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod_id(self) -> int:
        return self._eod

    @property
    def identity(self) -> str:
        """SHA-256 of vocab.json and merges.txt: what token files were made with."""
        return self._identity

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_document(self, text: str) -> list[int]:
        return self.encode(text) + [self._eod]

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of `text` as the start of a document (a prompt, a text to score): GPT-2's
        documents start with no special token."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; eod tokens are dropped."""
        return self._tok.decode([int(i) for i in ids if int(i) != self._eod])

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))

    def export(self, directory: str, max_length: int) -> list[str]:
        """Write what Hugging Face loads beside a GPT-2's weights: vocab.json and merges.txt
        (GPT2Tokenizer), tokenizer.json (`tokenizers` alone, GPT2TokenizerFast) and the
        tokenizer config naming <|endoftext|>. Returns the file names written."""
        shutil.copyfile(self.files[0], os.path.join(directory, 'vocab.json'))
        shutil.copyfile(self.files[1], os.path.join(directory, 'merges.txt'))
        self._tok.save(os.path.join(directory, 'tokenizer.json'))
        special = dict(bos_token=EOD_TOKEN, eos_token=EOD_TOKEN, unk_token=EOD_TOKEN)
        tokenizer_config = dict(
            special, tokenizer_class='GPT2Tokenizer', model_max_length=max_length,
            add_prefix_space=False,
        )  # fmt: skip
        for name, content in (
            ('tokenizer_config.json', tokenizer_config),
            ('special_tokens_map.json', special),
        ):
            with open(os.path.join(directory, name), 'w') as f:
                json.dump(content, f, indent=2)
        return [
            'vocab.json',
            'merges.txt',
            'tokenizer.json',
            'tokenizer_config.json',
            'special_tokens_map.json',
        ]


def files_of(path: str) -> tuple[str, str] | None:
    """(vocab file, merge file) that `path` names, or None if it names no GPT-2 BPE: a
    directory holding vocab.json + merges.txt (or Megatron's gpt2-vocab.json +
    gpt2-merges.txt), or a file ending in vocab.json with the merges.txt of the same prefix
    beside it (gpt2-vocab.json -> gpt2-merges.txt)."""
    if os.path.isdir(path):
        for vocab, merges in FILE_NAMES:
            if os.path.isfile(os.path.join(path, vocab)):
                return os.path.join(path, vocab), os.path.join(path, merges)
        return os.path.join(path, FILE_NAMES[0][0]), os.path.join(path, FILE_NAMES[0][1])
    if path.endswith('vocab.json'):
        return path, path[: -len('vocab.json')] + 'merges.txt'
    return None


def _write_atomically(path, text):
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)
    os.replace(tmp, path)
