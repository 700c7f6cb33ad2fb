"""Raw text to a Megatron indexed dataset: read documents, tokenize them in parallel, write.

Inputs: `.jsonl`/`.json` files hold one JSON object per line with the document under a key
(Megatron's convention, "text"); any other file is one plain-text document; folders are walked
in sorted order (hidden entries skipped). Empty documents are dropped; with append_eod every
other one gets the end-of-document token appended (Tokenizer.encode_document). Several json
keys write one dataset per key, as Megatron-LM's tools/preprocess_data.py does.

    reader (this process) --chunks of documents--> N worker processes (tokenize)
            --> in order --> IndexedDatasetWriter (streams .bin; the .idx is built at the end)

At most a few chunks per worker are in flight, so memory stays flat however large the corpus;
the output appears only once complete, with the tokenizer's identity beside it
(PREFIX.identity.json, identity.py). launch/preprocess.py is the command line.
"""

import collections
import itertools
import json
import multiprocessing
import os
import time

import numpy as np
from tqdm import tqdm

from mtnlg_jax.data import identity
from mtnlg_jax.data.indexed import IndexedDatasetWriter, token_dtype
from mtnlg_jax.data.tokenizer import from_files
from mtnlg_jax.data.tokenizer import load as load_tokenizer

JSON_SUFFIXES = ('.jsonl', '.json')
IN_FLIGHT_PER_WORKER = 4
CHUNK_CHARACTERS = 1 << 17


class InputError(ValueError):
    """Unusable input: the message names the file (and line)."""


def input_files(paths):
    """The files of `paths`, folders expanded recursively in sorted order."""
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
                for name in sorted(files):
                    if not name.startswith('.'):
                        yield os.path.join(root, name)
        else:
            yield path


def records(paths, json_keys=('text',)):
    """Each input document as a tuple of its texts under `json_keys`, streamed; InputError
    naming the file (and line) if bad. A plain-text file is one document of a single key."""
    for path in input_files(paths):
        try:
            with open(path, encoding='utf-8') as f:
                if not path.endswith(JSON_SUFFIXES):
                    if len(json_keys) > 1:
                        raise InputError(
                            f'{path}: a plain-text file has no keys; several --json-keys '
                            'need jsonl input'
                        )
                    text = f.read()
                    if text:
                        yield (text,)
                    continue
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        texts = tuple(record[key] for key in json_keys)
                    except (ValueError, TypeError, KeyError):
                        texts = (None,)
                    if not all(isinstance(text, str) for text in texts):
                        keys = ', '.join(map(repr, json_keys))
                        raise InputError(f'{path}:{number}: not a JSON object with a string {keys}')
                    if any(texts):
                        yield texts
        except UnicodeDecodeError as e:
            raise InputError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start})') from None


def documents(paths, json_key='text'):
    """Each input document's text under `json_key`, streamed (see records)."""
    for (text,) in records(paths, (json_key,)):
        yield text


def _characters(texts):
    return sum(map(len, texts))


def chunks(items, max_documents, max_characters=CHUNK_CHARACTERS, size=_characters):
    """Lists of items (by default tuples of texts, one per json key) of at most max_documents,
    cut sooner at max_characters so that a few long documents still spread over the workers
    (`size`: an item's characters)."""
    chunk, characters = [], 0
    for item in items:
        chunk.append(item)
        characters += size(item)
        if len(chunk) == max_documents or characters >= max_characters:
            yield chunk
            chunk, characters = [], 0
    if chunk:
        yield chunk


_worker = None  # (tokenizer, token dtype, append_eod) of this worker process


def _start_worker(kind, files, append_eod):
    global _worker
    tokenizer = from_files(kind, files)
    _worker = tokenizer, token_dtype(tokenizer.vocab_size), append_eod


def _encode(chunk):
    """One chunk of documents (tuples of texts, one per key) -> per key: (the token ids of its
    non-empty texts, an eod after each with append_eod; tokens per document)."""
    tokenizer, dtype, append_eod = _worker
    encode = tokenizer.encode_document if append_eod else tokenizer.encode
    results = []
    for texts in zip(*chunk):
        ids = [np.asarray(encode(text), dtype) for text in texts if text]
        if not ids:
            results.append((np.zeros(0, dtype), np.zeros(0, np.int32)))
            continue
        results.append((np.concatenate(ids), np.fromiter(map(len, ids), np.int32, len(ids))))
    return results


def output_prefixes(output_prefix, json_keys):
    """Megatron's names for several --json-keys: PREFIX_KEY_document, one dataset per key."""
    return [f'{output_prefix}_{key}_document' for key in json_keys]


def tokenize(
    paths,
    tokenizer,
    output_prefix,
    json_key='text',
    workers=1,
    chunk_documents=64,
    append_eod=True,
    json_keys=None,
):
    """Stream the documents of `paths` through `workers` tokenizer processes into
    output_prefix.bin/.idx; with json_keys, one dataset per key at output_prefixes(..).
    tokenizer: a path (tokenizer.load) or a tokenizer. Returns (the finished writers, one per
    key, or the one writer without json_keys; seconds). InputError, before anything is
    written or shown, if the inputs hold no document at all."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    keys = tuple(json_keys) if json_keys else (json_key,)
    texts = records(paths, keys)
    first = next(texts, None)  # read before anything is written or shown
    if first is None:
        raise InputError(f'--input {" ".join(paths)}: no documents (every input is empty)')
    texts = itertools.chain([first], texts)
    prefixes = output_prefixes(output_prefix, keys) if json_keys else [output_prefix]
    writers = [IndexedDatasetWriter(p, token_dtype(tokenizer.vocab_size)) for p in prefixes]
    # delay: the bar appears only once the work takes a while, so an input that fails at once
    # leaves its error line alone on the terminal.
    progress = tqdm(desc='tokenizing', unit=' docs', unit_scale=True, mininterval=0.5, delay=1.0)
    start = time.perf_counter()
    worker_args = (tokenizer.kind, tokenizer.files, append_eod)

    def write(results):
        for writer, (tokens, lengths) in zip(writers, results):
            if len(lengths):
                writer.add_documents(tokens, lengths)
        progress.update(max(len(lengths) for _, lengths in results))
        rate = sum(w.tokens for w in writers) / max(time.perf_counter() - start, 1e-9)
        progress.set_postfix_str(f'{rate:,.0f} tokens/s', refresh=False)

    pool = None
    try:
        work = chunks(texts, chunk_documents)
        if workers == 1:
            _start_worker(*worker_args)
            for chunk in work:
                write(_encode(chunk))
        else:
            pool = multiprocessing.get_context('spawn').Pool(workers, _start_worker, worker_args)
            pending = collections.deque()
            for chunk in work:
                pending.append(pool.apply_async(_encode, (chunk,)))
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    write(pending.popleft().get())
            while pending:
                write(pending.popleft().get())
        for writer in writers:
            identity.finish(writer, tokenizer)  # .bin/.idx and the tokenizer's sidecar
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    seconds = max(time.perf_counter() - start, 1e-9)
    return (writers if json_keys else writers[0]), seconds
