"""Raw text to a Megatron indexed dataset: read documents, tokenize them on Ray, write.

Inputs: `.jsonl`/`.json` files hold one JSON object per line with the document under a key
(Megatron's convention, "text"); any other file is one plain-text document; folders are walked
in sorted order (hidden entries skipped; a curated folder's part files in manifest order).
Empty documents are dropped; with append_eod every other one gets the end-of-document token
appended (Tokenizer.encode_document). Several json keys write one dataset per key, as
Megatron-LM's tools/preprocess_data.py does.

    scan     a Ray task per input file: every line checked, pieces cut (pieces.py)
    tokenize Ray Data map over the pieces: each piece's .bin/.idx in PREFIX.work/
    merge    (driver, streamed) each input file's pieces into its shard (with several
             files), all of them into PREFIX.bin/.idx: the same bytes one writer would write

Only the merge holds anything per document: the .idx's sizes, as the format needs. The outputs
appear only once complete, each with the tokenizer's identity beside it (PREFIX.identity.json,
identity.py). launch/preprocess.py is the command line.
"""

import os
import shutil
import time

import numpy as np

from mtnlg_jax.data import identity
from mtnlg_jax.data import pieces as pieces_lib
from mtnlg_jax.data.indexed import IndexedDatasetWriter, token_dtype
from mtnlg_jax.data.indexed import merge as merge_datasets
from mtnlg_jax.data.pieces import (  # noqa: F401  (InputError, input_files: used from here)
    JSON_SUFFIXES,
    InputError,
    input_files,
    parse_line,
    plain_text_keys,
)
from mtnlg_jax.data.tokenizer import from_files
from mtnlg_jax.data.tokenizer import load as load_tokenizer

CHUNK_CHARACTERS = 1 << 17


def records(paths, json_keys=('text',)):
    """Each input document as a tuple of its texts under `json_keys`, streamed; InputError
    naming the file (and line) if bad. A plain-text file is one document of a single key."""
    for path in input_files(paths):
        try:
            with open(path, encoding='utf-8') as f:
                if not path.endswith(JSON_SUFFIXES):
                    plain_text_keys(path, json_keys)
                    text = f.read()
                    if text:
                        yield (text,)
                    continue
                for number, line in enumerate(f, 1):
                    texts = parse_line(path, number, line, json_keys)
                    if texts is not None and any(texts):
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


def _encode(chunk, tokenizer, append_eod):
    """One chunk of documents (tuples of texts, one per key) -> per key: (the token ids of its
    non-empty texts, an eod after each with append_eod; tokens per document)."""
    dtype = token_dtype(tokenizer.vocab_size)
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


_tokenizers = {}


def _tokenize_piece(batch, kind, files, keys, append_eod, folder):
    """A Ray task: one piece's documents into folder/piece-NNNNN[-k].bin/.idx, one per key."""
    piece = {k: v[0].item() if hasattr(v[0], 'item') else v[0] for k, v in batch.items()}
    if (kind, files) not in _tokenizers:
        _tokenizers[(kind, files)] = from_files(kind, files)
    tokenizer = _tokenizers[(kind, files)]
    dtype = token_dtype(tokenizer.vocab_size)
    writers = [IndexedDatasetWriter(f'{folder}/piece-{piece["piece"]:05d}-{k}', dtype)
               for k in range(len(keys))]  # fmt: skip
    texts = (t for _, t in pieces_lib.read(piece, keys))
    for chunk in chunks(texts, 64):
        for writer, (tokens, lengths) in zip(writers, _encode(chunk, tokenizer, append_eod)):
            if len(lengths):
                writer.add_documents(tokens, lengths)
    for writer in writers:
        writer.finish()
    return {'piece': np.array([piece['piece']]), 'documents': np.array([writers[0].documents])}


def _scan(path, keys, piece_bytes):
    try:
        return pieces_lib.scan(path, keys, piece_bytes)
    except InputError as e:
        return {'error': str(e)}


def tokenize(
    paths,
    tokenizer,
    output_prefix,
    json_key='text',
    workers=1,
    piece_mb=4,
    append_eod=True,
    json_keys=None,
    address=None,
    stall_timeout_s=900.0,
):
    """Tokenize the documents of `paths` on Ray (data/ray_engine.py: embedded with `workers`
    CPUs, or joined at `address`), a task per piece of input (pieces.py, piece_mb each), into
    output_prefix.bin/.idx; with json_keys, one dataset per key at output_prefixes(..). A
    curated folder's shards (launch/curate.py --output DIR/) also get their own
    OUTPUT_PREFIX.shards/NAME.bin/.idx; the merged prefix holds them in order. tokenizer: a
    path (tokenizer.load) or a tokenizer. Returns (the finished writers of the merged prefix,
    one per key, or the one writer without json_keys; seconds). InputError, before anything
    is written, for an unreadable input, a bad line anywhere, or no document at all. No
    piece finished for stall_timeout_s (0: no bound) ends the process (data/stall.py)."""
    from mtnlg_jax.data import ray_engine
    from mtnlg_jax.data.stall import StallWatch, beating

    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    keys = tuple(json_keys) if json_keys else (json_key,)
    prefixes = output_prefixes(output_prefix, keys) if json_keys else [output_prefix]
    start = time.perf_counter()
    with ray_engine.started(workers, address) as ray:
        scan = ray.remote(_scan)
        files = pieces_lib.files(paths)
        scans = ray.get([scan.remote(p, keys, int(piece_mb * (1 << 20))) for p in files])
        for found in scans:
            if 'error' in found:
                raise InputError(found['error'])
        pieces = pieces_lib.numbered(scans)
        if not sum(p['documents'] for p in pieces):
            raise InputError(f'--input {" ".join(paths)}: no documents (every input is empty)')
        folder = f'{output_prefix}.work'
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        try:
            kwargs = dict(kind=tokenizer.kind, files=tuple(tokenizer.files), keys=keys,
                          append_eod=append_eod, folder=folder)  # fmt: skip
            items = ray.data.from_items(pieces, override_num_blocks=len(pieces))
            tokenized = items.map_batches(
                beating(_tokenize_piece, folder), batch_size=1, fn_kwargs=kwargs
            )
            with StallWatch(folder, stall_timeout_s, 'preprocess', resumes=False) as watch:
                watch.stage('tokenize')
                tokenized.materialize()
            curated = any(os.path.isfile(os.path.join(p, 'manifest.json')) for p in paths)
            writers = _merge(scans, pieces, prefixes, folder, tokenizer, curated)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    seconds = max(time.perf_counter() - start, 1e-9)
    return (writers if json_keys else writers[0]), seconds


def _merge(scans, pieces, prefixes, folder, tokenizer, curated):
    """The pieces into one dataset per shard (each file of a curated folder) and the merged
    one, each with the tokenizer's identity beside it."""
    dtype, writers = token_dtype(tokenizer.vocab_size), []

    def merge(parts, prefix, dtype):
        return merge_datasets(parts, prefix, dtype, lambda w: identity.finish(w, tokenizer))

    for k, prefix in enumerate(prefixes):
        parts = [f'{folder}/piece-{p["piece"]:05d}-{k}' for p in pieces]
        if curated and len(scans) > 1:
            names = [os.path.splitext(os.path.basename(s['path']))[0] for s in scans]
            unique = len(set(names)) == len(names)
            for number, (scanned, name) in enumerate(zip(scans, names)):
                own = [part for part, p in zip(parts, pieces) if p['path'] == scanned['path']]
                shard = f'{prefix}.shards/{name if unique else f"{number:05d}-{name}"}'
                merge(own, shard, dtype)
        writers.append(merge(parts, prefix, dtype))
    return writers
