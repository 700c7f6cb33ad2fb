"""What token files mean and what a run reads: the tokenizer's identity beside each `.bin/.idx`,
and the fingerprint of a run's data stream.

    PREFIX.bin, PREFIX.idx       Megatron's indexed dataset (indexed.py)
    PREFIX.identity.json         the tokenizer that made it (this module; Megatron's reader opens
                                 only .bin and .idx, so it ignores this file):
        {"format": "mtnlg_jax.tokenizer_identity/1", "kind": "SentencePieceTokenizer",
         "identity": "<sha256 of the tokenizer's files>", "vocab_size": 8192,
         "files": ["tokenizer.model"]}

A token id means a piece only under the tokenizer that produced it; Megatron's `.bin/.idx`
carries no trace of it, so a run trained or scored on files of another tokenizer of the same
size would go on silently. `check` refuses such files (one line naming both tokenizers) and
warns once per file for files without the sidecar (made by Megatron-LM, or before it existed).

The stream fingerprint (`stream`) is everything that decides which tokens a run reads in
which order: each source's weight, prefix, file sizes and tokenizer, the split, the order,
the sequence length and the seed. A workdir records it (rundir.py's identity.json), and a
resume that changes it says what changed and needs an explicit flag (launch/train.py).
"""

import functools
import json
import os
import sys

from mtnlg_jax.data import gpt2_bpe
from mtnlg_jax.data import tokenizer as tokenizer_lib
from mtnlg_jax.data.indexed import DataError, IndexedDataset

SUFFIX = '.identity.json'
FORMAT = 'mtnlg_jax.tokenizer_identity/1'
_warned = set()  # prefixes already warned about (once per process)


def record(tokenizer):
    """The identity of a loaded tokenizer (data/tokenizer.py's load), as stored."""
    return dict(
        format=FORMAT,
        kind=tokenizer.kind,
        identity=tokenizer.identity,
        vocab_size=tokenizer.vocab_size,
        files=[os.path.basename(path) for path in tokenizer.files],
    )


def of_path(path):
    """The record of the tokenizer `path` names (data.tokenizer), or None for '' (a run of
    token ids alone); TokenizerError if it cannot be opened. Cached per path and file times."""
    if not path:
        return None
    files = (*(gpt2_bpe.files_of(path) or ()), path, os.path.join(path, tokenizer_lib.HF_FILE))
    return _of_path(path, tuple(os.stat(f).st_mtime_ns for f in files if os.path.isfile(f)))


@functools.lru_cache(maxsize=8)
def _of_path(path, mtimes):
    del mtimes  # the cache key: a file rewritten in place is read again
    return record(tokenizer_lib.load(path))


def describe(found):
    """A tokenizer record for people: 'SentencePieceTokenizer tokenizer.model (8192 pieces,
    sha256 1a2b3c4d5e6f)'."""
    files = ' + '.join(found.get('files') or ['?'])
    return (
        f'{found.get("kind", "?")} {files} ({found.get("vocab_size", "?")} pieces, '
        f'sha256 {str(found.get("identity", "?"))[:12]})'
    )


def same(a, b):
    """Whether two tokenizer records are one tokenizer (its files' bytes, not its size)."""
    return a['identity'] == b['identity']


def sidecar_path(prefix):
    return prefix + SUFFIX


def write(prefix, tokenizer_record):
    """PREFIX.identity.json, atomically (a killed write leaves none or the old one)."""
    path = sidecar_path(prefix)
    tmp = f'{path}.tmp{os.getpid()}'
    try:
        with open(tmp, 'w') as f:
            json.dump(tokenizer_record, f, indent=1)
            f.write('\n')
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def finish(writer, tokenizer):
    """writer.finish() (an IndexedDatasetWriter) with the tokenizer's sidecar: an old one is
    removed first, so files are never beside another tokenizer's identity, only (if killed
    in between) beside none."""
    path = sidecar_path(writer.prefix)
    if os.path.exists(path):
        os.remove(path)
    writer.finish()
    write(writer.prefix, record(tokenizer))


def read(prefix):
    """The tokenizer record beside PREFIX.bin/.idx, or None without one; DataError if the
    file is not one."""
    path = sidecar_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f'{path}: not a readable tokenizer identity ({e})') from None
    if not isinstance(found, dict) or found.get('format') != FORMAT or 'identity' not in found:
        raise DataError(f'{path}: not a tokenizer identity (expected format {FORMAT})')
    return found


def check(prefix, expected, against, warn=True):
    """The tokenizer record of PREFIX's files (None without a sidecar: warn_once, unless
    warn=False, for a tool that warns only once its other checks have passed);
    DataError naming both tokenizers if it is not `expected` (a record; None: nothing to
    compare with). `against` says where `expected` came from ('data.tokenizer', ...)."""
    found = read(prefix)
    if found is None:
        if warn:
            warn_once(prefix)
        return None
    if expected is not None and not same(found, expected):
        raise DataError(
            f'{prefix}.bin was made by {describe(found)}, but {against} is '
            f'{describe(expected)}: its token ids mean other pieces (preprocess it again with '
            'this tokenizer)'
        )
    return found


def warn_once(prefix):
    """The warning for PREFIX's files having no sidecar, once per process."""
    if prefix in _warned:
        return
    _warned.add(prefix)
    print(
        f'warning: {prefix}.bin has no {os.path.basename(sidecar_path(prefix))} (made by '
        "Megatron-LM?): its tokenizer is not checked against the run's",
        file=sys.stderr,
        flush=True,
    )


def agreed(records, what):
    """The one tokenizer record all of `records` (prefix -> record or None) share, or None if
    none has one; DataError naming two that differ."""
    known = [(prefix, found) for prefix, found in records.items() if found is not None]
    for prefix, found in known[1:]:
        if not same(found, known[0][1]):
            raise DataError(
                f'{what}: {known[0][0]}.bin was made by {describe(known[0][1])}, but '
                f'{prefix}.bin by {describe(found)}: one run reads one tokenizer\'s ids'
            )
    return known[0][1] if known else None


def check_sources(config, warn=True):
    """prefix -> the tokenizer record of each data.sources file (None without a sidecar);
    DataError if one is missing, or was made by a tokenizer other than data.tokenizer (with
    none: than the others). Training and the Megatron-order path read through this check."""
    for _, prefix in config.data.sources:
        IndexedDataset(prefix)  # a missing or bad file is named before any sidecar warning
    path = config.data.tokenizer
    try:  # a tokenizer file that is missing is launch/train.py's error, not the loader's
        expected = of_path(path) if path and os.path.exists(path) else None
    except tokenizer_lib.TokenizerError as e:
        raise DataError(f'data.tokenizer: {e}') from None
    against = f'data.tokenizer={config.data.tokenizer}'
    found = {prefix: check(prefix, expected, against, warn) for _, prefix in config.data.sources}
    agreed(found, 'data.sources')
    return found


def run_record(config):
    """What a workdir records of a run (rundir.py's identity.json): its tokenizer (data.tokenizer's,
    or with none the one its data files name), its vocabulary and its stream fingerprint;
    DataError if the data cannot be read or its tokenizers disagree."""
    files = check_sources(config, warn=False)  # launch/train.py warns once all checks pass
    tokenizer = of_path(config.data.tokenizer) or agreed(files, 'data.sources')
    return dict(tokenizer=tokenizer, vocab_size=config.model.vocab_size, data=stream(config, files))


def _file_sizes(prefix):
    sizes = {}
    for suffix in ('.idx', '.bin'):
        path = prefix + suffix
        if not os.path.isfile(path):
            raise DataError(f'{path}: no such file (launch/preprocess.py writes it)')
        sizes[suffix[1:] + '_bytes'] = os.path.getsize(path)
    return sizes


def stream(config, tokenizers):
    """The data stream's fingerprint of a resolved config: a JSON-ready dict.
    tokenizers: prefix -> the tokenizer record of its files (or None)."""
    sources = []
    for weight, prefix in config.data.sources:
        found = tokenizers.get(prefix)
        sources.append(
            dict(
                weight=float(weight),
                prefix=os.path.abspath(prefix),
                tokenizer=found['identity'] if found else None,
                **_file_sizes(prefix),
            )
        )
    return dict(
        sources=sources,
        split=config.data.split,
        order=config.data.order,
        seq_len=config.model.seq_len,
        seed=config.train.seed,
    )


def stream_changes(before, after):
    """['what: old -> new', ...] of the files behind the sources two stream fingerprints
    share (rewritten, or made by another tokenizer): what the config keys do not show."""
    old = {s['prefix']: s for s in before.get('sources', [])}
    changes = []
    for source in after.get('sources', []):
        then = old.get(source['prefix'])
        for key in ('bin_bytes', 'idx_bytes', 'tokenizer'):
            if then is not None and then.get(key) != source.get(key):
                changes.append(
                    f'{source["prefix"]} {key}: {then.get(key)!r} -> {source.get(key)!r}'
                )
    return changes
