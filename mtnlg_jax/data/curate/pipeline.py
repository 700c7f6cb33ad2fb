"""The curation's options, and pass 3 of one piece: its survivors filtered and written.

    pass 1  signatures (stages.signature_rows), per piece                     [Ray tasks]
    exact   groups by fingerprint: a hash-keyed shuffle (stages.exact_groups) [Ray]
    fuzzy   buckets by band: a band-keyed shuffle (stages.band_rows, bucket_members); the
            shingles of bucket members read per piece; exact Jaccard per bucket
            (stages.verified_edges); only the verified edges reach the driver, which joins
            them into clusters and keeps one document each (fuzzy.EdgeForest)
    pass 3  per piece (filter_piece): the piece read again, the duplicates skipped, quality
            and decontamination on the rest, its part file written whole       [Ray tasks]

engine.py runs these on Ray; the functions here are pure and import no Ray.
"""

import dataclasses
import json
import os
import time

from mtnlg_jax.data import pieces as pieces_lib
from mtnlg_jax.data.curate import decontaminate as decontaminate_lib
from mtnlg_jax.data.curate import quality
from mtnlg_jax.data.curate.report import EXAMPLE_CHARACTERS, StageReport

STAGES = ('exact', 'fuzzy', 'quality', 'decontaminate')
PIECE_DOCUMENTS = 256  # documents scored by the classifier at once


@dataclasses.dataclass
class Options:
    stages: tuple = ('exact', 'fuzzy', 'quality')
    threshold: float = 0.8  # Jaccard at or above which two documents are duplicates
    num_perm: int = 128
    shingle_words: int = 5
    seed: int = 1
    rules: quality.Rules = quality.Rules()
    heuristics: bool = True
    classifier: object = None  # a fitted quality.Classifier, or None
    classifier_threshold: float = 0.5
    contaminants: object = None  # decontaminate.contaminants(...) of the evaluation sets
    rule: decontaminate_lib.Rule = decontaminate_lib.Rule()
    workers: int = 1
    json_key: str = 'text'
    examples: int = 3
    shard_mb: float = 32.0  # input bytes per piece (and output shard)
    part_documents: int = 20000  # documents per partition of a shuffle
    drill: str = None  # 'signatures' / 'stall': the worker of piece 0 dies / hangs once
    stall_timeout_s: float = 900.0  # no progress for this long ends the run (data/stall.py)


def filter_documents(chunk, options):
    """Pass 3 on (index, text) pairs: per document [index, size, quality failure or None,
    score, pieces, regions, what was removed (for the report's examples)]; seconds of each."""
    started, out = time.process_time(), []
    for index, text in chunk:
        failure = None
        if 'quality' in options.stages and options.heuristics:
            failure = quality.heuristic_failure(text, options.rules)
        out.append([index, len(text.encode('utf-8')), failure, None, [], [], text])
    if 'quality' in options.stages and options.classifier is not None:
        passing = [k for k, row in enumerate(out) if row[2] is None]
        if passing:
            scores = options.classifier.score([chunk[k][1] for k in passing])
            for k, score in zip(passing, scores):
                out[k][3] = float(score)
                if score < options.classifier_threshold:
                    out[k][2] = 'classifier'
    quality_s = time.process_time() - started
    for row, (_, text) in zip(out, chunk):
        if row[2] is None and 'decontaminate' in options.stages:
            row[4], row[5] = decontaminate_lib.decontaminate(
                text, options.contaminants, options.rule
            )
            if row[5]:
                row[6] = text[row[5][0][0] : row[5][0][1]]
        elif row[2] is None:
            row[4] = [text]
        row[6] = row[6][:EXAMPLE_CHARACTERS] if row[2] is not None or row[5] else None
    return out, quality_s, time.process_time() - started - quality_s


def reports_of(options):
    reports = {s: StageReport(s, options.examples) for s in STAGES if s in options.stages}
    if 'decontaminate' in reports:
        reports['decontaminate'].details['pieces_out'] = 0
    return reports


def _account(reports, options, out, index, size, failure, score, pieces, regions, removed):
    """One filtered document into the reports, and its pieces into `out`."""
    if 'quality' in reports:
        report = reports['quality']
        report.take(size)
        if failure is not None:
            report.reasons[failure] += 1
            extra = {} if score is None else {'score': round(score, 4)}
            report.example(index, removed, reason=failure, **extra)
            return 0
        report.give(size)
    if 'decontaminate' in reports:
        report = reports['decontaminate']
        report.take(size)
        if pieces:  # a document counts as out if any piece of it is
            report.give(sum(len(p.encode('utf-8')) for p in pieces))
            report.details['pieces_out'] += len(pieces)
        if regions:
            dropped = len(regions) > options.rule.max_matches
            report.reasons['dropped (too many matches)' if dropped else 'cut'] += 1
            report.example(index, removed, matches=len(regions), pieces_kept=len(pieces))
    for piece in pieces:
        out.write(json.dumps({'text': piece}, ensure_ascii=False) + '\n')
    return len(pieces)


def _deduplicated(piece, options, removed, reports):
    """The piece's (index, text) pairs that no deduplication removed; accounts for both."""
    for index, (text,) in pieces_lib.read(piece, (options.json_key,)):
        size = len(text.encode('utf-8'))
        stage = removed.get(index, (None,))[0]
        for name in ('exact', 'fuzzy'):
            if name in reports:
                reports[name].take(size)
                if stage == name:
                    _, kept, jaccard = removed[index]
                    extra = {} if jaccard is None else {'jaccard': jaccard}
                    reports[name].example(index, text, kept=kept, **extra)
                    break
                reports[name].give(size)
        if stage is None:
            yield index, text


def filter_piece(piece, removed, options, path):
    """Pass 3 of one piece into `path` (renamed into place once whole). removed: {index:
    (stage, kept index, jaccard or None)} of the piece's duplicates. Returns the piece's stage
    reports (as dicts) and the documents written."""
    reports, written, chunk = reports_of(options), 0, []
    temporary = f'{path}.tmp{os.getpid()}'
    with open(temporary, 'w', encoding='utf-8') as out:

        def flush():
            rows, quality_s, decontaminate_s = filter_documents(chunk, options)
            for stage, seconds in (('quality', quality_s), ('decontaminate', decontaminate_s)):
                if stage in reports:
                    reports[stage].seconds += seconds
            chunk.clear()
            return sum(_account(reports, options, out, *row) for row in rows)

        for item in _deduplicated(piece, options, removed, reports):
            chunk.append(item)
            if len(chunk) == PIECE_DOCUMENTS:
                written += flush()
        written += flush() if chunk else 0
    os.replace(temporary, path)
    return {s: r.as_dict() for s, r in reports.items()}, written
