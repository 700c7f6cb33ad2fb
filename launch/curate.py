#!/usr/bin/env python3
"""Curate documents as MT-NLG did: deduplicate, filter by quality, decontaminate (jsonl out).

Exact and fuzzy deduplication, quality filtering, decontamination against evaluation sets;
jsonl (or any input preprocess.py reads) in, jsonl out, on Ray (an embedded one of --workers
CPUs, or the cluster at --ray_address).

    python launch/curate.py --input raw/web.jsonl --output curated/web.jsonl [--workers 2] \\
        [--stages exact fuzzy quality decontaminate] [--threshold 0.8] \\
        [--quality_reference good.jsonl --classifier_threshold 0.5] [--eval lambada.jsonl ...]
    python launch/curate.py --input crawl/ --output curated/crawl/ --ray_address HEAD:6379
        # -> curated/crawl/part-NNNNN.jsonl, manifest.json, report.json

Stages run in that order, whatever order they are named in: exact (normalised text), fuzzy
(MinHash + LSH, Jaccard >= --threshold, one document kept per cluster), quality (Gopher's
heuristics; with --quality_reference also a classifier trained on that good text against a
sample of the input), decontaminate (GPT-3's 13-gram rule against the --eval files; the
default stages include it when --eval is given). Writes OUTPUT and OUTPUT's .report.json
(documents and bytes in, out and removed per stage, why, and examples), each only once
complete. `--output DIR/` writes one part-NNNNN.jsonl per piece of input (--shard_mb), a
manifest.json (inputs and their SHA-256, options, documents per shard) and report.json.
Partial work lives in --work_dir (default OUTPUT.work): a failed run, rerun alike, resumes at
the stage that failed. Bad input prints one line `error: ...` and exits with status 2; a run
in which no work finishes for --stall_timeout_s (900 s) prints one line and exits with status 3,
its finished stages kept for the rerun (mtnlg_jax/data/stall.py).
"""

import os
import sys
import time

try:
    import mtnlg_jax  # noqa: F401  (normally pip-installed in editable mode)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtnlg_jax.data.curate import decontaminate, engine, pipeline, quality, workdir
from mtnlg_jax.data.curate.report import report_path, table
from mtnlg_jax.data.pieces import sha256
from mtnlg_jax.data.preprocess import InputError, documents, input_files
from mtnlg_jax.run import storage
from mtnlg_jax.run.cli import ArgumentParser, output_problem


def parse_args(argv):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--input', nargs='+', required=True, help='jsonl / text files or folders')
    p.add_argument(
        '--output', required=True, help='FILE.jsonl ({"text": ...} lines), or DIR/ for shards'
    )
    p.add_argument(
        '--stages',
        nargs='+',
        choices=pipeline.STAGES,
        help='default: exact fuzzy quality, and decontaminate when --eval is given',
    )
    p.add_argument('--workers', type=int, default=1, help='CPUs of Ray used')
    p.add_argument('--ray_address', help="HOST:PORT of a running Ray cluster's GCS")
    p.add_argument('--work_dir', help='partial work, for a rerun to resume (OUTPUT.work)')
    p.add_argument('--shard_mb', type=float, default=32.0, help='input MB per piece and shard')
    p.add_argument('--part_documents', type=int, default=20000, help='per shuffle partition')
    p.add_argument(
        '--drill', choices=('signatures', 'stall'), help='kill / hang one worker once (a drill)'
    )
    p.add_argument(
        '--stall_timeout_s', type=float, default=900.0,
        help='end the run when no work finishes for this long (0: never; data/stall.py)',
    )  # fmt: skip
    p.add_argument('--json_key', default='text')
    p.add_argument('--examples', type=int, default=3, help='removed documents shown per stage')
    g = p.add_argument_group('fuzzy deduplication')
    g.add_argument('--threshold', type=float, default=0.8, help='Jaccard of duplicates, (0, 1]')
    g.add_argument('--num_perm', type=int, default=128, help='MinHash permutations')
    g.add_argument('--shingle_words', type=int, default=5, help='words per shingle')
    g.add_argument('--seed', type=int, default=1, help='of the MinHash permutations')
    g = p.add_argument_group('quality filtering')
    g.add_argument('--no_heuristics', action='store_true', help="skip Gopher's rules")
    g.add_argument('--min_words', type=int, default=quality.Rules.min_words)
    g.add_argument('--quality_reference', nargs='+', help='good text: trains the classifier')
    g.add_argument('--classifier_threshold', type=float, default=0.5, help='keep P(good) >= this')
    g.add_argument(
        '--classifier_samples',
        type=int,
        default=5000,
        help='documents of each class the classifier is trained on, at most',
    )
    g = p.add_argument_group('decontamination')
    g.add_argument('--eval', nargs='+', help='evaluation sets (jsonl: every string field; text)')
    g.add_argument('--ngram', type=int, default=13, help='words per contaminating n-gram')
    args = p.parse_args(argv)
    _check(args)
    return args


def _check(args):
    for flag, paths in (
        ('--input', args.input),
        ('--quality_reference', args.quality_reference),
        ('--eval', args.eval),
    ):
        for path in paths or ():
            if not os.path.exists(path):
                raise InputError(f'{flag} {path}: no such file or folder')
            for name in input_files([path]):
                try:
                    open(name, 'rb').close()
                except OSError as e:
                    raise InputError(f'{flag} {name}: {e.strerror or e}') from None
    if args.stall_timeout_s < 0:
        raise InputError(f'--stall_timeout_s must be >= 0, got {args.stall_timeout_s:g}')
    if not 0 < args.shard_mb <= 1 << 20:
        raise InputError(f'--shard_mb must be positive, got {args.shard_mb}')
    for flag, value in (
        ('--threshold', args.threshold),
        ('--classifier_threshold', args.classifier_threshold),
    ):
        if not 0 < value <= 1:
            raise InputError(f'{flag} must be in (0, 1], got {value}')
    for flag, value, low, high in (
        ('--workers', args.workers, 1, 256),
        ('--num_perm', args.num_perm, 8, 1024),
        ('--shingle_words', args.shingle_words, 1, 64),
        ('--ngram', args.ngram, 1, 64),
        ('--part_documents', args.part_documents, 1, 1 << 30),
        ('--classifier_samples', args.classifier_samples, 2, 1 << 24),
        ('--min_words', args.min_words, 0, 1 << 30),
        ('--examples', args.examples, 0, 1000),
    ):
        if not low <= value <= high:
            raise InputError(f'{flag} must be in [{low}, {high}], got {value}')
    if args.stages is None:
        args.stages = ['exact', 'fuzzy', 'quality'] + (['decontaminate'] if args.eval else [])
    if 'decontaminate' in args.stages and not args.eval:
        raise InputError('--stages decontaminate needs --eval FILES (the evaluation sets)')
    if args.quality_reference and 'quality' not in args.stages:
        raise InputError("--quality_reference given but 'quality' is not in --stages")
    output = os.path.abspath(args.output)
    if os.path.isdir(output) and not args.output.endswith(os.sep):
        raise InputError(f'--output {args.output}: is a folder (end it with / for shards)')
    shards = args.output.endswith(os.sep)
    problem = output_problem(output, directory=shards) or (
        None if shards else output_problem(report_path(output))
    )
    if problem:
        raise InputError(f'--output {args.output}: {problem}')
    if any(os.path.abspath(name) == output for name in input_files(args.input)):
        raise InputError(f'--output {args.output}: is one of the inputs')
    if args.output.endswith(os.sep) and os.path.isdir(output):
        foreign = [n for n in os.listdir(output) if not n.startswith(('part-', 'manifest.json',
                   'report.json'))]  # fmt: skip
        if foreign:
            raise InputError(f'--output {args.output}: holds {foreign[0]}, not curated shards')


def identity(args):
    """What the classifier and the evaluation n-grams are made from: the files' hashes."""
    found = {}
    for flag in ('quality_reference', 'eval'):
        files = [f for path in getattr(args, flag) or () for f in input_files([path])]
        found[flag] = [sha256(f) for f in files]
    return {**found, 'classifier_samples': args.classifier_samples, 'ngram': args.ngram}


def options(args):
    """The pipeline's options; trains the classifier and reads the evaluation sets first."""
    chosen = pipeline.Options(
        stages=tuple(s for s in pipeline.STAGES if s in args.stages),
        threshold=args.threshold,
        num_perm=args.num_perm,
        shingle_words=args.shingle_words,
        seed=args.seed,
        heuristics=not args.no_heuristics,
        rules=quality.Rules(min_words=args.min_words),
        classifier_threshold=args.classifier_threshold,
        workers=args.workers,
        json_key=args.json_key,
        shard_mb=args.shard_mb,
        part_documents=args.part_documents,
        drill=args.drill,
        stall_timeout_s=args.stall_timeout_s,
        examples=args.examples,
        rule=decontaminate.Rule(n=args.ngram),
    )
    if args.quality_reference:
        start = time.perf_counter()
        good = quality.sample_by_hash(
            documents(args.quality_reference, args.json_key), args.classifier_samples
        )
        raw = quality.sample_by_hash(documents(args.input, args.json_key), args.classifier_samples)
        if not good:
            names = ' '.join(args.quality_reference)
            raise InputError(f'--quality_reference {names}: no documents')
        if not raw:
            raise InputError(f'--input {" ".join(args.input)}: no documents')
        chosen.classifier = quality.Classifier().fit(good, raw)
        print(
            f'classifier   trained on {len(good):,} reference and {len(raw):,} raw documents '
            f'({time.perf_counter() - start:.1f} s)'
        )
    if 'decontaminate' in chosen.stages:
        chosen.contaminants = decontaminate.contaminants(
            decontaminate.evaluation_texts(args.eval), args.ngram
        )
        if not len(chosen.contaminants):
            raise InputError(f'--eval {" ".join(args.eval)}: no {args.ngram}-gram in it')
        print(f'evaluation   {len(chosen.contaminants):,} distinct {args.ngram}-grams')
    return chosen


def _report_path(output):
    if workdir.is_folder_output(output):
        return os.path.join(output, 'report.json')
    return report_path(output)


def main(argv=None):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        folder = os.path.dirname(args.output.rstrip(os.sep))
        if folder:
            os.makedirs(folder, exist_ok=True)
        chosen = options(args)
        report = engine.curate(args.input, args.output, chosen, args.work_dir, args.ray_address,
                               identity(args))  # fmt: skip
    except Exception as e:
        refused = storage.refusal(e)
        if not (refused or isinstance(e, (InputError, OSError))):
            raise
        if (refused or isinstance(e, OSError)) and os.path.exists(args.output + '.tmp'):
            os.remove(args.output + '.tmp')  # a full disk: no half-written output left
        if refused:  # a run gone wrong, not bad input: status 1
            room = storage.free_space(args.output)
            print(f'error: --output {args.output}: not written: {refused}; {room}', file=sys.stderr)
            return 1
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(table(report))
    lines, kept = report['lines_out'], report['documents_out']
    cut = f' as {lines:,} lines (cut around evaluation matches)' if lines != kept else ''
    print(
        f"wrote {args.output}: {kept:,} of {report['documents_in']:,} documents{cut} in "
        f"{report['seconds']:.1f} s with {report['workers']} worker(s), "
        f"{report['shards']} shard(s); report: {_report_path(args.output)}"
    )
    return 0


if __name__ == '__main__':
    sys.exit(main())
