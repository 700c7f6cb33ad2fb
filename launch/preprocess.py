#!/usr/bin/env python3
"""Raw text -> tokens -> a Megatron `.bin`/`.idx` pair (mtnlg_jax/data/indexed.py), with the
flags of Megatron-LM's tools/preprocess_data.py.

    python launch/preprocess.py --input corpus.jsonl [more files or folders ...] \
        --tokenizer-model data/tokenizer.model --output-prefix data/corpus --append-eod \
        [--workers 2]
    python launch/preprocess.py --input corpus.jsonl --json-keys text title \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --output-prefix data/corpus --append-eod --workers 8
        # -> data/corpus_text_document.bin/.idx and data/corpus_title_document.bin/.idx
    python launch/preprocess.py --input raw/ --train-tokenizer --vocab-size 8192 \
        --tokenizer-model data/tokenizer.model            # train only: no --output-prefix
    python launch/preprocess.py --input raw/ --train-tokenizer --vocab-size 8192 \
        --tokenizer-type GPT2BPETokenizer --vocab-file data/bpe/vocab.json \
        --merge-file data/bpe/merges.txt                   # a byte-level BPE, GPT-2's format
    python launch/preprocess.py --input corpus.jsonl --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model llama3/tokenizer.json --output-prefix data/llama --append-eod

Megatron's flags keep Megatron's meanings: `--json-keys K ...` writes one dataset per key,
named PREFIX_K_document as Megatron names them; `--append-eod` ends every document with the
end-of-document token (without it, none); `--tokenizer-type` SentencePieceTokenizer (with
`--tokenizer-model`), GPT2BPETokenizer (with `--vocab-file` and `--merge-file`, through Hugging
Face's `tokenizers`) or HuggingFaceTokenizer (`--tokenizer-model` a tokenizer.json, Llama 3's
for one: each document starts with the BOS its post-processor adds); `--workers` CPUs of an
embedded Ray (or the running cluster at `--ray_address HOST:PORT`). Beyond them: several
`--input` files and folders (a curated folder's shards in its manifest's order, each also
written to its own PREFIX.shards/NAME.bin/.idx), plain-text files (one
document each), `--json-key K` (one key, written to PREFIX.bin/.idx itself), and
`--train-tokenizer` (sentencepiece or a byte-level BPE). See mtnlg_jax/data/preprocess.py for
how input is read and written. Tokens are stored as uint16 when the vocabulary fits, else int32.
Bad input prints one line `error: ...` naming the argument or file and exits with status 2;
the output files appear only once complete, so a failed run leaves earlier ones as they were.
"""

import os
import sys
import time

try:
    import mtnlg_jax  # noqa: F401  (normally pip-installed in editable mode)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtnlg_jax.run.cli import ArgumentParser, output_problem  # noqa: E402
from mtnlg_jax.run import storage  # noqa: E402
from mtnlg_jax.data.gpt2_bpe import GPT2BPETokenizer  # noqa: E402
from mtnlg_jax.data.preprocess import InputError, documents, tokenize  # noqa: E402
from mtnlg_jax.data.tokenizer import KINDS, HFTokenizer, Tokenizer, TokenizerError  # noqa: E402


def parse_args(argv):
    p = ArgumentParser(description=__doc__)
    p.add_argument('--input', nargs='+', required=True, help='jsonl / text files or folders')
    p.add_argument('--output-prefix', help='writes PREFIX.bin/.idx (PREFIX_KEY_document.*)')
    keys = p.add_mutually_exclusive_group()
    keys.add_argument('--json-keys', nargs='+', help='one dataset per key (Megatron)')
    keys.add_argument('--json-key', default='text', help='the one key, written to PREFIX')
    p.add_argument('--tokenizer-type', choices=KINDS, help='default: GPT2BPETokenizer with '
                   '--vocab-file, HuggingFaceTokenizer with a --tokenizer-model ending in .json, '
                   'else SentencePieceTokenizer')  # fmt: skip
    p.add_argument('--tokenizer-model', help='sentencepiece .model to use or train, or a Hugging '
                   'Face tokenizer.json to use')  # fmt: skip
    p.add_argument('--vocab-file', help='GPT-2 BPE vocab.json to use or train')
    p.add_argument('--merge-file', help='GPT-2 BPE merges.txt to use or train')
    p.add_argument('--append-eod', action='store_true', help='end each document with eod')
    p.add_argument('--workers', type=int, default=1, help='CPUs of Ray used')
    p.add_argument('--ray_address', help="HOST:PORT of a running Ray cluster's GCS")
    p.add_argument('--train-tokenizer', action='store_true', help='train the tokenizer first')
    p.add_argument('--tokenizer-input', nargs='+', help='what to train it on (default: --input)')
    p.add_argument('--vocab-size', type=int, default=8192)
    p.add_argument('--model-type', choices=('bpe', 'unigram'), default='bpe', help='sentencepiece')
    p.add_argument('--seed', type=int, default=0, help='of the sentencepiece training')
    p.add_argument('--piece-mb', type=float, default=4.0, help='input MB per Ray task')
    p.add_argument(
        '--stall_timeout_s',
        type=float,
        default=900.0,
        help='end the run when no piece finishes for this long (0: never)',
    )
    args = p.parse_args(argv)
    for path in args.input + (args.tokenizer_input or []):
        if not os.path.exists(path):
            raise InputError(f'--input {path}: no such file or folder')
    if args.workers < 1 or not args.piece_mb > 0:
        raise InputError('--workers must be at least 1 and --piece-mb positive')
    if args.stall_timeout_s < 0:
        raise InputError(f'--stall_timeout_s must be >= 0, got {args.stall_timeout_s:g}')
    if args.tokenizer_type is None:
        hf = (args.tokenizer_model or '').endswith('.json')
        args.tokenizer_type = KINDS[1] if args.vocab_file else KINDS[2] if hf else KINDS[0]
    if args.tokenizer_type == KINDS[2] and args.train_tokenizer:
        raise InputError('--train-tokenizer makes a sentencepiece model or GPT-2 BPE files; '
                         'a HuggingFaceTokenizer is used as it is')  # fmt: skip
    if args.tokenizer_type == 'GPT2BPETokenizer':
        if args.tokenizer_model:
            raise InputError('--tokenizer-model is sentencepiece\'s: GPT2BPETokenizer takes '
                             '--vocab-file and --merge-file')  # fmt: skip
        files = {'--vocab-file': args.vocab_file, '--merge-file': args.merge_file}
        minimum = 258
    else:
        if args.vocab_file or args.merge_file:
            raise InputError('--vocab-file and --merge-file need --tokenizer-type GPT2BPETokenizer')
        if args.tokenizer_type == KINDS[2] and not args.tokenizer_model:
            raise InputError('--tokenizer-model (a tokenizer.json) is required with '
                             '--tokenizer-type HuggingFaceTokenizer')  # fmt: skip
        files = {'--tokenizer-model': args.tokenizer_model}
        minimum = 260
        if (
            args.train_tokenizer
            and args.tokenizer_model
            and not args.tokenizer_model.endswith('.model')
        ):
            raise InputError(f'--tokenizer-model {args.tokenizer_model}: must end in .model')
    for flag, path in files.items():
        if not path:
            raise InputError(f'{flag} is required with --tokenizer-type {args.tokenizer_type}')
        if not args.train_tokenizer and not os.path.isfile(path):
            raise InputError(f'{flag} {path}: no such file (add --train-tokenizer)')
    if args.train_tokenizer and args.vocab_size < minimum:
        raise InputError(f'--vocab-size must be at least {minimum}, got {args.vocab_size}')
    if not args.train_tokenizer and not args.output_prefix:
        raise InputError('--output-prefix is required unless --train-tokenizer is given')
    if not args.train_tokenizer:
        try:
            open_tokenizer(args)
        except Exception as e:  # whatever sentencepiece or tokenizers say of a foreign file
            flags = ' / '.join(f'{flag} {path}' for flag, path in files.items())
            kind = {KINDS[1]: 'GPT-2 BPE files', KINDS[2]: 'a Hugging Face tokenizer.json'}.get(
                args.tokenizer_type, 'a sentencepiece model'
            )
            raise InputError(f'{flags}: not {kind} ({e})') from None
    written = [('--output-prefix', args.output_prefix)]
    if args.train_tokenizer:
        written.append(('--tokenizer-model', args.tokenizer_model))
    for flag, path in written:  # each output's folder made now, so a bad one costs nothing
        problem = path and output_problem(path)  # files appear by rename: the folder decides
        if problem:
            raise InputError(f'{flag} {path}: {problem}')
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return args


def open_tokenizer(args):
    if args.tokenizer_type == 'GPT2BPETokenizer':
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if args.tokenizer_type == KINDS[2]:
        return HFTokenizer(args.tokenizer_model)
    return Tokenizer(args.tokenizer_model)


def train_tokenizer(args):
    """Train the tokenizer on the documents; a bad input file is reported as itself, not
    as the training failure it causes (the files are written only after training)."""
    input_errors = []

    def recorded(docs):
        try:
            yield from docs
        except InputError as e:
            input_errors.append(e)
            raise

    texts = recorded(documents(args.tokenizer_input or args.input, args.json_key))
    try:
        if args.tokenizer_type == 'GPT2BPETokenizer':
            return GPT2BPETokenizer.train(texts, args.vocab_file, args.merge_file, args.vocab_size)
        return Tokenizer.train(
            texts,
            args.tokenizer_model[: -len('.model')],
            args.vocab_size,
            model_type=args.model_type,
            seed=args.seed,
        )
    except Exception as e:  # sentencepiece and tokenizers raise their own kinds
        if input_errors:
            raise input_errors[0] from None
        if isinstance(e, TokenizerError):
            raise
        raise TokenizerError(f'tokenizer training failed: {e}') from None


def main(argv=None):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.train_tokenizer:
            start = time.perf_counter()
            trained = train_tokenizer(args)
            kind = args.model_type if trained.kind == KINDS[0] else 'byte-level BPE'
            print(
                f'trained {", ".join(trained.files)}: {args.tokenizer_type} ({kind}), vocab '
                f'{trained.vocab_size} ({time.perf_counter() - start:.1f} s)'
            )
        if not args.output_prefix:
            return 0
        writers, seconds = tokenize(
            args.input,
            open_tokenizer(args),
            args.output_prefix,
            args.json_key,
            args.workers,
            args.piece_mb,
            append_eod=args.append_eod,
            json_keys=args.json_keys,
            address=args.ray_address,
            stall_timeout_s=args.stall_timeout_s,
        )
        for writer in writers if args.json_keys else [writers]:
            print(
                f'wrote {writer.prefix}.bin/.idx: {writer.documents:,} documents, '
                f'{writer.tokens:,} tokens ({writer.dtype}) in {seconds:.1f} s: '
                f'{writer.documents / seconds:,.0f} documents/s, {writer.tokens / seconds:,.0f} '
                f'tokens/s with {args.workers} worker(s)'
            )
        return 0
    except Exception as e:
        refused = storage.refusal(e)
        if refused:  # a run gone wrong, not bad input: status 1
            where = args.output_prefix or args.tokenizer_model
            print(
                f'error: {where}: not written: {refused}; {storage.free_space(where)}',
                file=sys.stderr,
            )
            return 1
        if not isinstance(e, (InputError, TokenizerError, OSError)):
            raise
        print(f'error: {e}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
