#!/usr/bin/env python3
"""Raw text -> sentencepiece tokens -> a Megatron `.bin`/`.idx` pair (mtnlg_jax/data/indexed.py).

    python launch/preprocess.py --input corpus.jsonl [more files or folders ...] \\
        --tokenizer-model data/tokenizer.model --output-prefix data/corpus [--workers 2]
    python launch/preprocess.py --input raw/ --train-tokenizer --vocab-size 8192 \\
        --tokenizer-model data/tokenizer.model            # train only: no --output-prefix

Inputs: `.jsonl`/`.json` files (one JSON object per line, the document under `--json-key`),
other files (one plain-text document each) and folders of them; see mtnlg_jax/data/preprocess.py
for how they are read, tokenized by `--workers` processes and streamed to disk. Tokens are stored
as uint16 when the vocabulary fits, else int32; every document ends with the eod token.
Bad input prints one line `error: ...` naming the argument or file and exits with status 2;
the output files appear only once complete, so a failed run leaves earlier ones as they were.
"""

import argparse
import os
import sys
import time

try:
    import mtnlg_jax  # noqa: F401  (normally pip-installed in editable mode)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtnlg_jax.data.preprocess import InputError, documents, tokenize
from mtnlg_jax.data.tokenizer import Tokenizer, TokenizerError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise InputError(message)


def parse_args(argv):
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument('--input', nargs='+', required=True, help='jsonl / text files or folders')
    p.add_argument('--output-prefix', help='writes PREFIX.bin and PREFIX.idx')
    p.add_argument('--tokenizer-model', required=True, help='sentencepiece .model to use or train')
    p.add_argument('--train-tokenizer', action='store_true', help='train --tokenizer-model first')
    p.add_argument('--tokenizer-input', nargs='+', help='what to train it on (default: --input)')
    p.add_argument('--vocab-size', type=int, default=8192)
    p.add_argument('--model-type', choices=('bpe', 'unigram'), default='bpe')
    p.add_argument('--seed', type=int, default=0, help='of the tokenizer training')
    p.add_argument('--json-key', default='text')
    p.add_argument('--workers', type=int, default=1)
    p.add_argument('--chunk-documents', type=int, default=64, help='documents per worker task')
    args = p.parse_args(argv)
    for path in args.input + (args.tokenizer_input or []):
        if not os.path.exists(path):
            raise InputError(f'--input {path}: no such file or folder')
    if args.workers < 1 or args.chunk_documents < 1:
        raise InputError('--workers and --chunk-documents must be at least 1')
    if args.train_tokenizer:
        if not args.tokenizer_model.endswith('.model'):
            raise InputError(f'--tokenizer-model {args.tokenizer_model}: must end in .model')
        if args.vocab_size < 260:
            raise InputError(f'--vocab-size must be at least 260, got {args.vocab_size}')
    elif not os.path.isfile(args.tokenizer_model):
        raise InputError(
            f'--tokenizer-model {args.tokenizer_model}: no such file (add --train-tokenizer)'
        )
    elif not args.output_prefix:
        raise InputError('--output-prefix is required unless --train-tokenizer is given')
    return args


def train_tokenizer(args):
    """Train --tokenizer-model on the documents; a bad input file is reported as itself, not
    as the sentencepiece failure it causes (the model is written only after training)."""
    input_errors = []

    def recorded(docs):
        try:
            yield from docs
        except InputError as e:
            input_errors.append(e)
            raise

    try:
        return Tokenizer.train(
            recorded(documents(args.tokenizer_input or args.input, args.json_key)),
            args.tokenizer_model[: -len('.model')],
            args.vocab_size,
            model_type=args.model_type,
            seed=args.seed,
        )
    except TokenizerError:
        if input_errors:
            raise input_errors[0] from None
        raise


def main(argv=None):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.train_tokenizer:
            start = time.perf_counter()
            trained = train_tokenizer(args)
            print(
                f'trained {args.tokenizer_model}: {args.model_type}, vocab '
                f'{trained.vocab_size} ({time.perf_counter() - start:.1f} s)'
            )
        if not args.output_prefix:
            return 0
        writer, seconds = tokenize(
            args.input,
            args.tokenizer_model,
            args.output_prefix,
            args.json_key,
            args.workers,
            args.chunk_documents,
        )
        print(
            f'wrote {args.output_prefix}.bin/.idx: {writer.documents:,} documents, '
            f'{writer.tokens:,} tokens ({writer.dtype}) in {seconds:.1f} s: '
            f'{writer.documents / seconds:,.0f} documents/s, {writer.tokens / seconds:,.0f} '
            f'tokens/s with {args.workers} worker(s)'
        )
        return 0
    except (InputError, TokenizerError, OSError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
