"""Input files cut into pieces: the units curation and preprocessing hand to their workers.

    scan(file)  one pass over one file: its SHA-256, every line checked (the same rules and
                messages as preprocess.records), cut at line ends into pieces of about
                piece_bytes, with the documents each holds
    read(piece) the (global index, texts) of the piece's documents, by seeking into the file

A piece depends on the file's bytes and piece_bytes alone, never on workers or blocks; the
global index of a document is its position in the input, as records() would count it. A
plain-text (non-jsonl) file is one piece holding one document.
"""

import hashlib
import json
import os

JSON_SUFFIXES = ('.jsonl', '.json')


class InputError(ValueError):
    """Unusable input: the message names the file (and line)."""


def input_files(paths):
    """The files of `paths`, folders expanded recursively in sorted order; a folder curated
    into shards (launch/curate.py --output DIR/) gives its shards in its manifest's order."""
    for path in paths:
        manifest = os.path.join(path, 'manifest.json')
        if os.path.isdir(path) and os.path.isfile(manifest):
            with open(manifest) as f:
                yield from (os.path.join(path, shard['file']) for shard in json.load(f)['shards'])
        elif os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
                for name in sorted(files):
                    if not name.startswith('.'):
                        yield os.path.join(root, name)
        else:
            yield path


def parse_line(path, number, line, json_keys):
    """The texts under json_keys of one jsonl line (None for a blank line); InputError naming
    the file and line if it is not a JSON object with a string under each key."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
        texts = tuple(record[key] for key in json_keys)
    except (ValueError, TypeError, KeyError):
        texts = (None,)
    if not all(isinstance(text, str) for text in texts):
        keys = ', '.join(map(repr, json_keys))
        raise InputError(f'{path}:{number}: not a JSON object with a string {keys}')
    return texts


def plain_text_keys(path, json_keys):
    """A plain-text file is one document of a single key: InputError for several keys."""
    if len(json_keys) > 1:
        raise InputError(
            f'{path}: a plain-text file has no keys; several --json-keys need jsonl input'
        )


def _decoded(path, raw, offset):
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        at = offset + e.start
        raise InputError(f'{path}: not UTF-8 text ({e.reason} at byte {at})') from None


def scan(path, json_keys, piece_bytes):
    """{'path', 'bytes', 'sha256', 'pieces': [[start, end, documents], ...]}; InputError (file
    and line) for an unreadable file or a bad line anywhere in it."""
    digest, pieces, offset, start, documents = hashlib.sha256(), [], 0, 0, 0
    try:
        with open(path, 'rb') as f:
            if not path.endswith(JSON_SUFFIXES):
                plain_text_keys(path, json_keys)
                raw = f.read()
                digest.update(raw)
                text = _decoded(path, raw, 0)
                return {
                    'path': path,
                    'bytes': len(raw),
                    'sha256': digest.hexdigest(),
                    'pieces': [[0, len(raw), int(bool(text))]],
                }
            for number, raw in enumerate(f, 1):
                digest.update(raw)
                texts = parse_line(path, number, _decoded(path, raw, offset), json_keys)
                offset += len(raw)
                documents += texts is not None and any(texts)
                if offset - start >= piece_bytes:
                    pieces.append([start, offset, documents])
                    start, documents = offset, 0
    except OSError as e:
        raise InputError(f'--input {path}: {e.strerror or e}') from None
    if offset > start or not pieces:
        pieces.append([start, offset, documents])
    return {'path': path, 'bytes': offset, 'sha256': digest.hexdigest(), 'pieces': pieces}


def numbered(scans):
    """The pieces of all scanned files in input order, each a dict: piece (its number), path,
    start, end, first (the global index of its first document), documents."""
    out, first = [], 0
    for scanned in scans:
        for start, end, documents in scanned['pieces']:
            out.append(
                {
                    'piece': len(out),
                    'path': scanned['path'],
                    'start': start,
                    'end': end,
                    'first': first,
                    'documents': documents,
                }
            )
            first += documents
    return out


def read(piece, json_keys):
    """(global index, texts) of each document of the piece, in order."""
    path, index = piece['path'], piece['first']
    with open(path, 'rb') as f:
        f.seek(piece['start'])
        data = f.read(piece['end'] - piece['start'])
    if not path.endswith(JSON_SUFFIXES):
        text = data.decode('utf-8')
        if text:
            yield index, (text,)
        return
    for line in data.decode('utf-8').split('\n'):
        texts = parse_line(path, 0, line, json_keys)
        if texts is not None and any(texts):
            yield index, texts
            index += 1


def sha256(path):
    """The SHA-256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def files(paths):
    """The input files of `paths` (folders walked as preprocess walks them)."""
    return list(input_files(paths))
