"""Raw text to a Megatron indexed dataset: read documents, tokenize them in parallel, write.

Inputs: `.jsonl`/`.json` files hold one JSON object per line with the document under a key
(Megatron's convention, "text"); any other file is one plain-text document; folders are walked
in sorted order (hidden entries skipped). Empty documents are dropped; every other one gets the
end-of-document token appended (Tokenizer.encode_document).

    reader (this process) --chunks of documents--> N worker processes (tokenize)
            --> in order --> IndexedDatasetWriter (streams .bin; the .idx is built at the end)

At most a few chunks per worker are in flight, so memory stays flat however large the corpus;
the output appears only once complete. launch/preprocess.py is the command line.
"""

import collections
import json
import multiprocessing
import os
import time

import numpy as np
from tqdm import tqdm

from mtnlg_jax.data.indexed import IndexedDatasetWriter, token_dtype
from mtnlg_jax.data.tokenizer import Tokenizer

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


def documents(paths, json_key):
    """Each input document's text, streamed; InputError naming the file (and line) if bad."""
    for path in input_files(paths):
        try:
            with open(path, encoding='utf-8') as f:
                if not path.endswith(JSON_SUFFIXES):
                    text = f.read()
                    if text:
                        yield text
                    continue
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[json_key]
                    except (ValueError, TypeError, KeyError):
                        text = None
                    if not isinstance(text, str):
                        raise InputError(
                            f'{path}:{number}: not a JSON object with a string {json_key!r}'
                        )
                    if text:
                        yield text
        except UnicodeDecodeError as e:
            raise InputError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start})') from None


def chunks(texts, max_documents, max_characters=CHUNK_CHARACTERS):
    """Lists of texts of at most max_documents, cut sooner at max_characters so that a few
    long documents still spread over the workers."""
    chunk, characters = [], 0
    for text in texts:
        chunk.append(text)
        characters += len(text)
        if len(chunk) == max_documents or characters >= max_characters:
            yield chunk
            chunk, characters = [], 0
    if chunk:
        yield chunk


_worker = None  # (tokenizer, token dtype) of this worker process


def _start_worker(model_path):
    global _worker
    tokenizer = Tokenizer(model_path)
    _worker = tokenizer, token_dtype(tokenizer.vocab_size)


def _encode(texts):
    """One chunk -> (its token ids with an eod after each document, tokens per document)."""
    tokenizer, dtype = _worker
    ids = [np.asarray(tokenizer.encode_document(text), dtype) for text in texts]
    return np.concatenate(ids), np.fromiter(map(len, ids), np.int32, len(ids))


def tokenize(paths, tokenizer_model, output_prefix, json_key='text', workers=1, chunk_documents=64):
    """Stream the documents of `paths` through `workers` tokenizer processes into
    output_prefix.bin/.idx. Returns (the finished writer, seconds)."""
    vocab_size = Tokenizer(tokenizer_model).vocab_size
    writer = IndexedDatasetWriter(output_prefix, token_dtype(vocab_size))
    progress = tqdm(desc='tokenizing', unit=' docs', unit_scale=True, mininterval=0.5)
    start = time.perf_counter()

    def write(result):
        writer.add_documents(*result)
        progress.update(len(result[1]))
        rate = writer.tokens / max(time.perf_counter() - start, 1e-9)
        progress.set_postfix_str(f'{rate:,.0f} tokens/s', refresh=False)

    pool = None
    try:
        work = chunks(documents(paths, json_key), chunk_documents)
        if workers == 1:
            _start_worker(tokenizer_model)
            for chunk in work:
                write(_encode(chunk))
        else:
            pool = multiprocessing.get_context('spawn').Pool(
                workers, _start_worker, (tokenizer_model,)
            )
            pending = collections.deque()
            for chunk in work:
                pending.append(pool.apply_async(_encode, (chunk,)))
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    write(pending.popleft().get())
            while pending:
                write(pending.popleft().get())
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    return writer, max(time.perf_counter() - start, 1e-9)
