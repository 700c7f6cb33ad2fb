"""The curation pipeline: three streaming passes over the input, stages in MT-NLG's order.

    pass 1  read -> workers: fingerprint (exact), shingles -> MinHash signature (fuzzy)
            main: exact duplicate groups (one sort); LSH candidate pairs over the survivors
    pass 2  read -> workers: shingle sets of the LSH candidates only
            main: exact Jaccard of candidate pairs -> clusters -> one document kept each
    pass 3  read, skip the duplicates -> workers: heuristics, classifier, decontamination
            main: write the survivors (and the pieces decontamination leaves) in input order

Every pass streams: chunks of documents go to the worker processes with at most a few chunks
per worker in flight, so no pass holds the texts. What the main process keeps between passes
is per document and small (sizes, hashes, a signature; see fuzzy.py), plus the shingles of
fuzzy candidates. The output and its report appear only once complete.
"""

import collections
import dataclasses
import json
import multiprocessing
import os
import resource
import time

import numpy as np
from tqdm import tqdm

from mtnlg_jax.data.curate import decontaminate as decontaminate_lib
from mtnlg_jax.data.curate import exact, fuzzy, quality
from mtnlg_jax.data.curate.report import EXAMPLE_CHARACTERS, StageReport, report_path
from mtnlg_jax.data.preprocess import InputError, chunks, documents

STAGES = ('exact', 'fuzzy', 'quality', 'decontaminate')
IN_FLIGHT_PER_WORKER = 4
CHUNK_CHARACTERS = 1 << 18


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
    chunk_documents: int = 256
    json_key: str = 'text'
    examples: int = 3


# ------------------------------------------------------------------ worker side
_options = None
_signer = None


def _start_worker(options):
    global _options, _signer
    _options = options
    _signer = fuzzy.Signer(options.num_perm, options.seed) if 'fuzzy' in options.stages else None


def _signatures(chunk):
    """Pass 1 on (index, text) pairs: sizes, content hashes, fingerprints, signatures."""
    started = time.process_time()
    sizes = np.array([len(t.encode('utf-8')) for _, t in chunk], np.int64)
    hashes = np.array([exact.content_hash(t) for _, t in chunk], np.uint64)
    fingerprints = signatures = None
    if 'exact' in _options.stages:
        fingerprints = np.stack([exact.fingerprint(t) for _, t in chunk])
    exact_s = time.process_time() - started
    if _signer is not None:
        n = _options.shingle_words
        signatures = np.stack([_signer(fuzzy.shingles(t, n)) for _, t in chunk])
    return sizes, hashes, fingerprints, signatures, exact_s, time.process_time() - started - exact_s


def _shingle_sets(chunk):
    """Pass 2: the shingles of candidate documents."""
    started = time.process_time()
    found = [(i, fuzzy.shingles(t, _options.shingle_words)) for i, t in chunk]
    return found, time.process_time() - started


def _filter(chunk):
    """Pass 3: per document [index, size, quality failure or None, score, pieces, regions,
    what was removed (for the report's examples)]."""
    started, out = time.process_time(), []
    for index, text in chunk:
        failure = None
        if 'quality' in _options.stages and _options.heuristics:
            failure = quality.heuristic_failure(text, _options.rules)
        out.append([index, len(text.encode('utf-8')), failure, None, [], [], text])
    if 'quality' in _options.stages and _options.classifier is not None:
        passing = [k for k, row in enumerate(out) if row[2] is None]
        if passing:
            scores = _options.classifier.score([chunk[k][1] for k in passing])
            for k, score in zip(passing, scores):
                out[k][3] = float(score)
                if score < _options.classifier_threshold:
                    out[k][2] = 'classifier'
    quality_s = time.process_time() - started
    for row, (_, text) in zip(out, chunk):
        if row[2] is None and 'decontaminate' in _options.stages:
            row[4], row[5] = decontaminate_lib.decontaminate(
                text, _options.contaminants, _options.rule
            )
            if row[5]:
                row[6] = text[row[5][0][0] : row[5][0][1]]
        elif row[2] is None:
            row[4] = [text]
        row[6] = row[6][:EXAMPLE_CHARACTERS] if row[2] is not None or row[5] else None
    return out, quality_s, time.process_time() - started - quality_s


def peak_rss_mb():
    """This process's peak resident memory (VmHWM). Not ru_maxrss: a spawned worker's counts
    the parent's memory at fork time, before the exec that starts it."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measured(function, chunk):
    return function(chunk), peak_rss_mb()


# ------------------------------------------------------------------ main side
class _Workers:
    """An ordered map over chunks in `count` spawned processes (or in this one if count is 1),
    at most IN_FLIGHT_PER_WORKER chunks per worker queued."""

    def __init__(self, count, options):
        self.count, self.pool, self.peak_rss_mb = count, None, 0.0
        if count == 1:
            _start_worker(options)
        else:
            context = multiprocessing.get_context('spawn')
            self.pool = context.Pool(count, _start_worker, (options,))

    def map(self, function, chunks):
        if self.pool is None:
            yield from map(function, chunks)
            return
        pending = collections.deque()
        for chunk in chunks:
            pending.append(self.pool.apply_async(_measured, (function, chunk)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.count:
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    def _result(self, pending):
        result, peak = pending.get()
        self.peak_rss_mb = max(self.peak_rss_mb, peak)
        return result

    def close(self):
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


def _chunks(indexed_texts, max_documents):
    """Chunks of (index, text) pairs, cut as preprocess cuts chunks of texts."""
    return chunks(indexed_texts, max_documents, CHUNK_CHARACTERS, size=lambda item: len(item[1]))


def _progress(description, total=None):
    # delay: a run that fails on its first lines prints its error alone, no empty bar first
    return tqdm(
        desc=description, total=total, unit=' docs', unit_scale=True, mininterval=0.5, delay=1
    )


class Curation:
    """One run of the pipeline over `paths` into `output` (jsonl)."""

    def __init__(self, paths, output, options):
        self.paths, self.output, self.options = paths, output, options
        self.stages = {s: StageReport(s, options.examples) for s in STAGES if s in options.stages}
        self.removed = {}  # document index -> (stage, kept index, jaccard or None)
        if 'decontaminate' in self.stages:
            self.stages['decontaminate'].details['pieces_out'] = 0

    def _read(self, wanted=None):
        for index, text in enumerate(documents(self.paths, self.options.json_key)):
            if wanted is None or wanted(index):
                yield index, text

    def _pass_signatures(self, workers):
        parts, chunks = [], _chunks(self._read(), self.options.chunk_documents)
        with _progress('curate 1/3: hashing') as progress:
            for result in workers.map(_signatures, chunks):
                parts.append(result[:4])
                for stage, seconds in zip(('exact', 'fuzzy'), result[4:]):
                    if stage in self.stages:
                        self.stages[stage].seconds += seconds
                progress.update(len(result[0]))
        if not parts:
            raise InputError(f'--input {" ".join(map(str, self.paths))}: no documents')
        columns = [np.concatenate(c) if c[0] is not None else None for c in zip(*parts)]
        self.sizes, self.hashes, fingerprints, signatures = columns
        alive = np.ones(len(self.sizes), bool)
        if 'exact' in self.stages:
            removed, kept = exact.duplicates(fingerprints, self.sizes, self.hashes)
            self._account('exact', alive, removed)
            for i in np.flatnonzero(removed):
                self.removed[int(i)] = ('exact', int(kept[i]), None)
            alive &= ~removed
        if 'fuzzy' in self.stages:
            started = time.process_time()
            keys = np.flatnonzero(alive)
            self.pairs, (bands, rows) = fuzzy.candidate_pairs(
                signatures[keys], keys, self.options.threshold, self.options.num_perm
            )
            self.stages['fuzzy'].details.update(
                threshold=self.options.threshold,
                num_perm=self.options.num_perm,
                shingle_words=self.options.shingle_words,
                bands=bands,
                rows=rows,
                candidate_pairs=len(self.pairs),
            )
            self.stages['fuzzy'].seconds += time.process_time() - started
        return alive

    def _pass_clusters(self, workers, alive):
        report = self.stages['fuzzy']
        candidates = {i for pair in self.pairs for i in pair}
        shingle_sets = {}
        chunks = _chunks(self._read(candidates.__contains__), self.options.chunk_documents)
        with _progress('curate 2/3: verifying', len(candidates)) as progress:
            for found, seconds in workers.map(_shingle_sets, chunks):
                shingle_sets.update(found)
                report.seconds += seconds
                progress.update(len(found))
        started = time.process_time()
        groups, checked, edges = fuzzy.clusters(self.pairs, shingle_sets, self.options.threshold)
        kept = fuzzy.kept_of_clusters(groups, self.sizes, self.hashes)
        similarity = {}
        for (a, b), value in edges.items():
            similarity.setdefault(a, value)
            similarity.setdefault(b, value)
        removed = np.zeros(len(alive), bool)
        for i, best in kept.items():
            removed[i] = True
            self.removed[i] = ('fuzzy', best, round(similarity.get(i, 0.0), 3))
        self._account('fuzzy', alive, removed)
        report.details.update(verified_pairs=checked, clusters=len(groups))
        report.seconds += time.process_time() - started
        return alive & ~removed

    def _account(self, stage, alive, removed):
        report = self.stages[stage]
        report.documents_in, report.bytes_in = int(alive.sum()), int(self.sizes[alive].sum())
        out = alive & ~removed
        report.documents_out, report.bytes_out = int(out.sum()), int(self.sizes[out].sum())

    def _pass_filter(self, workers, alive, out):
        """Stream the survivors through the filters into `out`; examples of the removed."""
        wanted = {s: r for s, r in self.stages.items() if s in ('quality', 'decontaminate')}
        example_indices = collections.defaultdict(list)
        for i, (stage, _, _) in sorted(self.removed.items()):
            if len(example_indices[stage]) < self.options.examples:
                example_indices[stage].append(i)
        examples = {i: stage for stage, found in example_indices.items() for i in found}

        def survivors():
            for index, text in self._read():
                if index in examples:
                    stage, best, jaccard = self.removed[index]
                    extra = {'kept': best}
                    if jaccard is not None:
                        extra['jaccard'] = jaccard
                    self.stages[stage].example(index, text, **extra)
                if alive is None or alive[index]:
                    yield index, text

        total = None if alive is None else int(alive.sum())
        written, chunks = 0, _chunks(survivors(), self.options.chunk_documents)
        with _progress('curate 3/3: filtering', total) as progress:
            for rows, quality_s, decontaminate_s in workers.map(_filter, chunks):
                for stage, seconds in (('quality', quality_s), ('decontaminate', decontaminate_s)):
                    if stage in wanted:
                        wanted[stage].seconds += seconds
                for row in rows:
                    written += self._write(out, *row)
                progress.update(len(rows))
        return written

    def _write(self, out, index, size, failure, score, pieces, regions, removed_text):
        if 'quality' in self.stages:
            report = self.stages['quality']
            report.take(size)
            if failure is not None:
                report.reasons[failure] += 1
                extra = {} if score is None else {'score': round(score, 4)}
                report.example(index, removed_text, reason=failure, **extra)
                return 0
            report.give(size)
        if 'decontaminate' in self.stages:
            report = self.stages['decontaminate']
            report.take(size)
            if pieces:  # a document counts as out if any piece of it is
                report.give(sum(len(p.encode('utf-8')) for p in pieces))
                report.details['pieces_out'] += len(pieces)
            if regions:
                dropped = len(regions) > self.options.rule.max_matches
                report.reasons['dropped (too many matches)' if dropped else 'cut'] += 1
                report.example(index, removed_text, matches=len(regions), pieces_kept=len(pieces))
        for piece in pieces:
            out.write(json.dumps({'text': piece}, ensure_ascii=False) + '\n')
        return len(pieces)

    def run(self):
        started = time.perf_counter()
        workers = _Workers(self.options.workers, self.options)
        temporary = self.output + '.tmp'
        try:
            alive = None
            if 'exact' in self.stages or 'fuzzy' in self.stages:
                alive = self._pass_signatures(workers)
                if 'fuzzy' in self.stages:
                    alive = self._pass_clusters(workers, alive)
            with open(temporary, 'w', encoding='utf-8') as out:
                written = self._pass_filter(workers, alive, out)
            if alive is None and not any(r.documents_in for r in self.stages.values()):
                raise InputError(f'--input {" ".join(map(str, self.paths))}: no documents')
            workers.close()
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise
        finally:
            if workers.pool is not None:
                workers.pool.terminate()
        report = self._report(written, time.perf_counter() - started, workers.peak_rss_mb)
        os.replace(temporary, self.output)
        with open(report_path(self.output), 'w') as f:
            json.dump(report, f, indent=1)
        return report

    def _report(self, written, seconds, worker_peak_mb):
        sizes = getattr(self, 'sizes', None)
        first = next(iter(self.stages.values()))
        return {
            'input': [str(p) for p in self.paths],
            'output': self.output,
            'documents_in': first.documents_in if sizes is None else len(sizes),
            'bytes_in': first.bytes_in if sizes is None else int(sizes.sum()),
            'documents_out': written,
            'workers': self.options.workers,
            'seconds': round(seconds, 2),
            'peak_rss_main_mb': round(peak_rss_mb(), 1),
            'peak_rss_worker_mb': round(worker_peak_mb, 1),  # the largest; 0: in the main one
            'stages': [r.as_dict() for r in self.stages.values()],
        }


def curate(paths, output, options):
    """Run the stages of `options` over the documents of `paths` into `output`; the report."""
    return Curation(paths, output, options).run()
