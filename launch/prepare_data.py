#!/usr/bin/env python3
"""Build the default training data: corpus -> tokenizer -> token files.

    python launch/prepare_data.py --out data/default

Writes into ``--out``:

* ``tokenizer.model`` / ``tokenizer.vocab`` -- sentencepiece, trained on the
  train documents only (see mtnlg_jax/data/tokenizer.py);
* ``train.npy`` / ``valid.npy`` -- every document of the split, tokenized with
  an eod token appended, concatenated (uint16 for vocabularies up to 65536);
* ``meta.json`` -- the arguments, vocab size, eod id, token counts per split
  and per source, and the tokenizer's identity (sha256 of the model file).

The split is per document and stratified per source: for each source, the
documents at the first ``round(valid_fraction * n)`` positions (at least one)
of a permutation seeded by ``(seed, crc32(source name))`` go to valid.  Every
step is deterministic, so the same setup always yields identical files.

If ``meta.json`` exists and was made with the same arguments (and the same
corpus versions), nothing is done and "up to date" is printed.  meta.json is
written last and removed first, so an interrupted run is never "up to date".
Bad arguments print one ``error: ...`` line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

try:
    import mtnlg_jax  # noqa: F401  (normally pip-installed in editable mode)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import sentencepiece
from tqdm import tqdm

from mtnlg_jax.data.corpus import corpus_fingerprint, default_sources
from mtnlg_jax.data.loader import token_dtype, write_token_file
from mtnlg_jax.data.tokenizer import Tokenizer, TokenizerError

FORMAT_VERSION = 1
SPLITS = ("train", "valid")


class UsageError(Exception):
    """Bad input: reported as one ``error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def parse_args(argv):
    p = _Parser(description="Build the default corpus, tokenizer and token files.")
    p.add_argument("--out", required=True, help="output directory (e.g. data/default)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--valid-fraction", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.vocab_size < 260:
        raise UsageError(f"--vocab-size must be at least 260, got {args.vocab_size}")
    if not 0.0 < args.valid_fraction < 0.5:
        raise UsageError(f"--valid-fraction must be in (0, 0.5), got {args.valid_fraction}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} exists and is not a directory")
    return args


def split_documents(name: str, n: int, valid_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask over a source's ``n`` documents: True = valid."""
    n_valid = min(n - 1, max(1, round(valid_fraction * n))) if n > 1 else 0
    perm = np.random.default_rng([seed, zlib.crc32(name.encode())]).permutation(n)
    mask = np.zeros(n, dtype=bool)
    mask[perm[:n_valid]] = True
    return mask


def build(args, config: dict) -> dict:
    t0 = time.perf_counter()
    docs, source_of, is_valid = [], [], []
    for name, factory in default_sources():
        source_docs = list(factory())
        docs += source_docs
        source_of += [name] * len(source_docs)
        is_valid += split_documents(name, len(source_docs), args.valid_fraction, args.seed).tolist()
    sources = list(dict.fromkeys(source_of))
    print(
        f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} M characters "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    t1 = time.perf_counter()
    tok = Tokenizer.train(
        (d for d, v in zip(docs, is_valid) if not v),
        os.path.join(args.out, "tokenizer"),
        args.vocab_size,
        model_type=args.model_type,
        seed=args.seed,
    )
    print(
        f"tokenizer: {args.model_type}, vocab {tok.vocab_size} ({time.perf_counter() - t1:.1f} s)"
    )

    t2 = time.perf_counter()
    parts = {s: [] for s in SPLITS}
    counts = {s: {src: {"documents": 0, "tokens": 0} for src in sources} for s in SPLITS}
    for doc, src, valid in tqdm(
        zip(docs, source_of, is_valid), total=len(docs), desc="tokenizing", unit="doc"
    ):
        split = "valid" if valid else "train"
        ids = tok.encode_document(doc)
        parts[split].append(np.asarray(ids, dtype=token_dtype(tok.vocab_size)))
        counts[split][src]["documents"] += 1
        counts[split][src]["tokens"] += len(ids)
    totals = {}
    for split in SPLITS:
        tokens = np.concatenate(parts[split])
        write_token_file(os.path.join(args.out, f"{split}.npy"), tokens)
        totals[split] = int(tokens.size)
    print(
        f"tokenized in {time.perf_counter() - t2:.1f} s: "
        + ", ".join(f"{s} {totals[s]:,} tokens" for s in SPLITS)
    )
    return {
        "config": config,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "token_dtype": str(token_dtype(tok.vocab_size)),
        "tokenizer": "tokenizer.model",
        "tokenizer_identity": tok.identity,
        "files": {s: f"{s}.npy" for s in SPLITS},
        "tokens": totals,
        "per_source": counts,
    }


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        config = {
            "format": FORMAT_VERSION,
            "vocab_size": args.vocab_size,
            "model_type": args.model_type,
            "valid_fraction": args.valid_fraction,
            "seed": args.seed,
            "sentencepiece": sentencepiece.__version__,
            **corpus_fingerprint(),
        }
        meta_path = os.path.join(args.out, "meta.json")
        if _up_to_date(args.out, meta_path, config):
            print(f"{args.out}: up to date")
            return 0
        try:
            os.makedirs(args.out, exist_ok=True)
            if os.path.exists(meta_path):
                os.remove(meta_path)
        except OSError as exc:
            raise UsageError(f"cannot use --out {args.out}: {exc.strerror or exc}") from exc
        t0 = time.perf_counter()
        meta = build(args, config)
        tmp = meta_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(meta, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, meta_path)
        print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
        return 0
    except (UsageError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _up_to_date(out: str, meta_path: str, config: dict) -> bool:
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return False
    files = ["tokenizer.model"] + [f"{s}.npy" for s in SPLITS]
    return meta.get("config") == config and all(os.path.isfile(os.path.join(out, f)) for f in files)


if __name__ == "__main__":
    sys.exit(main())
