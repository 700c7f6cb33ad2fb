"""The curation run on Ray (data/ray_engine.py): pieces in, shards and a report out.

    scan        a Ray task per input file: hashes, every line checked, pieces cut
    signatures  Ray Data map over the pieces              -> WORK/signatures/ (parquet)
    exact       grouped by fingerprint part                -> WORK/exact/
    fuzzy       band rows -> by bucket part: members -> by piece: shingles ->
                by bucket part: verified edges -> the driver: clusters from the edges
                                                    -> WORK/fuzzy/ (the removed documents)
    filter      by piece, over the removed rows and one marker row per piece:
                each piece's survivors filtered into WORK/parts/part-NNNNN.jsonl (+ .json:
                its stage reports)
    outputs     workdir.place: the parts concatenated into FILE.jsonl, or moved into DIR/

Each stage's output marks it done (a folder's .done file, a file renamed into place), so a
rerun with the same inputs and options starts at the stage that failed and, in the filter
stage, at the pieces not yet written. Each "grouped by" is shuffle.grouped, through
WORK/shuffle/. What the driver holds: per input file, per piece and per shuffle partition a
few numbers, and while fuzzy deduplication joins its clusters, the spanning forest of its
verified edges (fuzzy.EdgeForest: about 56 bytes for each document in a cluster); every other
per-document row lives in Ray's object store or the work folder.
"""

import functools
import os
import shutil
import time

import numpy as np

from mtnlg_jax.data import pieces as pieces_lib
from mtnlg_jax.data import ray_engine
from mtnlg_jax.data.stall import StallWatch, beating
from mtnlg_jax.data.curate import exact, fuzzy, pipeline, shuffle, stages, workdir
from mtnlg_jax.data.curate.report import merged
from mtnlg_jax.data.preprocess import InputError

_cache = {}
# Ray Data's blocks at most this size (its default, 128 MiB, is reached only by corpora of
# hundreds of thousands of documents; a read gives the whole of a smaller stage's output as
# one block): a map task holds a block in and a block out, so a worker's memory stays flat as
# the corpus grows. A shuffle's reduce task holds one group (shuffle.grouped).
BLOCK_MB = 8


def _shared(ref):
    """An object put once in Ray's store (the options, the pieces), read once per worker."""
    import ray

    key = ref.hex()
    if key not in _cache:
        if len(_cache) > 4:
            _cache.clear()
        _cache[key] = ray.get(ref)
    return _cache[key]


def _drill(options, folder, piece):
    """--drill signatures: the worker of piece 0 exits once, as a killed process would;
    --drill stall: it hangs (the stall watch ends the run)."""
    marker = os.path.join(folder, f'drill.{options.drill}')
    if options.drill and piece == 0 and not os.path.exists(marker):
        open(marker, 'w').close()
        if options.drill == 'stall':
            time.sleep(1e9)
        os._exit(1)


def _signatures(batch, options_ref, folder, parts):
    options = _shared(options_ref)
    piece = {k: v[0].item() if hasattr(v[0], 'item') else v[0] for k, v in batch.items()}
    _drill(options, folder, piece['piece'])
    rows = stages.signature_rows(piece, options, parts)
    seconds = {s: float(rows.pop(f'{s}_s').sum()) for s in ('exact', 'fuzzy')}
    seconds['rss_mb'] = workdir.peak_rss_mb()
    workdir.write_json(os.path.join(folder, f'signatures-{piece["piece"]:05d}.json'), seconds)
    return rows


def _shingles(batch, pieces_ref):
    options, pieces = _shared(pieces_ref)
    return stages.candidate_shingles(batch, pieces[int(batch['piece'][0])], options)


def _filter(batch, pieces_ref, folder):
    options, pieces = _shared(pieces_ref)
    piece = int(batch['piece'][0])
    removed = {}
    for index, stage, kept, jaccard in zip(
        batch['index'], batch['stage'], batch['kept'], batch['jaccard']
    ):
        if index >= 0:
            jaccard = None if np.isnan(jaccard) else round(float(jaccard), 3)
            removed[int(index)] = (pipeline.STAGES[stage], int(kept), jaccard)
    path = os.path.join(folder, f'part-{piece:05d}.jsonl')
    reports, written = pipeline.filter_piece(pieces[piece], removed, options, path)
    workdir.write_json(path[: -len('.jsonl')] + '.json', {'stages': reports, 'written': written,
                       'rss_mb': workdir.peak_rss_mb()})  # fmt: skip
    return {'piece': np.array([piece])}


class Curation:
    """One run of the stages of `options` over `paths` into `output` (FILE.jsonl or DIR/)."""

    def __init__(self, paths, output, options, work=None, address=None, identity=None):
        self.paths, self.output, self.options, self.address = paths, output, options, address
        self.work = workdir.Work(work or workdir.default_folder(output), identity or {})
        self.shuffles = 0

    def run(self):
        started = time.perf_counter()
        with (
            ray_engine.started(self.options.workers, self.address, block_mb=BLOCK_MB) as ray,
            StallWatch(self.work.folder, self.options.stall_timeout_s, 'curate') as watch,
        ):
            self.watch = watch
            scans = self._scan(ray)
            self.pieces = pieces_lib.numbered(scans)
            self.documents = sum(p['documents'] for p in self.pieces)
            if not self.documents:
                raise InputError(f'--input {" ".join(map(str, self.paths))}: no documents')
            self.work.open(scans, self.options)
            self.parts = max(
                self.options.workers, -(-self.documents // self.options.part_documents)
            )
            self.options_ref = ray.put(self.options)
            self.pieces_ref = ray.put((self.options, self.pieces))
            self.seconds = {'exact': 0.0, 'fuzzy': 0.0}
            self._signatures(ray)
            self._exact(ray)
            fuzzy_details = self._fuzzy(ray)
            self._filter(ray)
        report = self._report(scans, fuzzy_details, time.perf_counter() - started)
        workdir.place(self.work, self.output, self.pieces, scans, self.options, report)
        return report

    def _scan(self, ray):
        scan = ray.remote(_scan_task)
        keys = (self.options.json_key,)
        piece_bytes = int(self.options.shard_mb * (1 << 20))
        found = ray.get([scan.remote(p, keys, piece_bytes) for p in pieces_lib.files(self.paths)])
        for result in found:
            if 'error' in result:
                raise InputError(result['error'])
        return found

    def _beating(self, fn):
        return beating(fn, self.work.folder)

    def _grouped(self, dataset, key, values, fn, **fn_kwargs):
        """shuffle.grouped through WORK/shuffle/KEY-N/ (the N-th shuffle of the run)."""
        self.shuffles += 1
        through = self.work.path(f"shuffle/{key}-{self.shuffles}")
        return shuffle.grouped(dataset, key, values, fn, through, self._beating, **fn_kwargs)

    def _shuffles_done(self):
        shutil.rmtree(self.work.path('shuffle'), ignore_errors=True)

    def _map(self, ray, name, build):
        """Run build() -> a Dataset into WORK/name/ (parquet) unless done; read it back."""
        folder = self.work.path(name)
        self.watch.stage(name)
        if not self.work.done(name):
            shutil.rmtree(folder, ignore_errors=True)
            build().write_parquet(folder)
            self.work.mark(name)
            self._shuffles_done()
        return _read_back(ray, folder)

    def _signatures(self, ray):
        def build():
            items = ray.data.from_items(self.pieces, override_num_blocks=len(self.pieces))
            kwargs = dict(options_ref=self.options_ref, folder=self.work.folder, parts=self.parts)
            return items.map_batches(self._beating(_signatures), batch_size=1, fn_kwargs=kwargs)

        self.signatures = self._map(ray, 'signatures', build)

    def _exact(self, ray):
        if 'exact' not in self.options.stages:
            self.exact = self.signatures.map_batches(
                lambda b: {**b, 'kept': b['index']}, batch_format='numpy'
            )
            return

        def build():
            exact_groups = self._beating(stages.exact_groups)
            return self._grouped(self.signatures, 'part', range(self.parts), exact_groups)

        self.exact = self._map(ray, 'exact', build)

    def _fuzzy(self, ray):
        """Fuzzy deduplication's details ({} without the stage); its removed documents in
        WORK/fuzzy/ (parquet: index, piece, kept, jaccard)."""
        if 'fuzzy' not in self.options.stages:
            return {}
        if self.work.done('fuzzy') and os.path.isdir(self.work.path('fuzzy')):
            return self.work.read_json('fuzzy.json')  # (a folder of an older engine: redone)
        self.watch.stage('fuzzy')
        bands, rows = fuzzy.bands_and_rows(self.options.threshold, self.options.num_perm)
        band_kwargs = dict(bands=bands, rows=rows, parts=self.parts)
        band_rows = self.exact.map_batches(
            self._beating(stages.band_rows), batch_format='numpy', fn_kwargs=band_kwargs
        )
        parts, pieces = range(self.parts), range(len(self.pieces))
        members = self._grouped(band_rows, 'part', parts, self._beating(stages.bucket_members))
        shingles = self._grouped(
            members, 'piece', pieces, self._beating(_shingles), pieces_ref=self.pieces_ref
        )
        edges = self._grouped(
            shingles,
            'part',
            parts,
            self._beating(stages.verified_edges),
            threshold=self.options.threshold,
        )
        removed, details = self._clusters(edges)
        self._shuffles_done()
        ray_engine.give_memory_back()
        details.update(bands=bands, rows=rows)
        folder = self.work.path('fuzzy')
        os.makedirs(folder, exist_ok=True)
        workdir.write_parquet(os.path.join(folder, 'removed.parquet'), removed)
        self.work.write_json('fuzzy.json', details)
        self.work.mark('fuzzy')
        return details

    def _clusters(self, edges):
        """The driver's share of fuzzy deduplication: clusters from the verified edges, one
        block at a time, holding only their spanning forest and one row per document in it
        (fuzzy.EdgeForest). Returns (the removed documents' columns, the stage's details)."""
        forest, documents, seconds = fuzzy.EdgeForest(), _documents_of_edges({}), 0.0
        checked = largest = pairs = 0
        for batch in edges.iter_batches(batch_size=None, batch_format='numpy'):
            seconds += float(batch['fuzzy_s'].sum())
            checked += int(batch['checked'].sum())
            largest = max(largest, int(batch['largest'].max(initial=0)))
            pairs += int(batch['pairs'].sum())
            started = time.process_time()
            real = {k: batch[k][batch['a'] >= 0] for k in stages._EDGE}
            forest.add(real['a'], real['b'], real['jaccard'])
            documents = _documents_of_edges(real, documents)
            seconds += time.process_time() - started
        started = time.process_time()
        nodes, labels, similarity = forest.components()
        assert np.array_equal(nodes, documents['index'])  # every edge's ends are in the forest
        # Each cluster keeps its first in exact.preference_order, as an exact group does.
        gone, kept = exact.duplicates(np.c_[labels, labels], documents['size'], documents['hash'])
        removed = {'index': nodes[gone], 'piece': documents['piece'][gone],
                   'kept': nodes[kept][gone], 'jaccard': similarity[gone]}  # fmt: skip
        details = {
            'bucket_pairs': pairs,
            'largest_bucket': largest,
            'verified_pairs': checked,
            'clusters': len(np.unique(labels)),
            'seconds': seconds + time.process_time() - started,
        }
        return {k: v.astype(np.float64 if k == 'jaccard' else np.int64) for k, v in
                removed.items()}, details  # fmt: skip

    def _filter(self, ray):
        folder = self.work.path('parts')
        os.makedirs(folder, exist_ok=True)
        undone = [p['piece'] for p in self.pieces if not self.work.part_done(p['piece'])]
        if not undone:
            return
        self.watch.stage('filter')
        stages_run = self.options.stages
        removed = _removed(
            ray,
            undone,
            exact=self.work.path('exact') if 'exact' in stages_run else None,
            fuzzy=self.work.path('fuzzy') if 'fuzzy' in stages_run else None,
        )
        kwargs = dict(pieces_ref=self.pieces_ref, folder=folder)
        self._grouped(removed, 'piece', undone, self._beating(_filter), **kwargs).materialize()
        self._shuffles_done()

    def _report(self, scans, fuzzy_details, seconds):
        per_piece = [self.work.read_json(f'parts/part-{p["piece"]:05d}.json') for p in self.pieces]
        stages_out = []
        for name in (s for s in pipeline.STAGES if s in self.options.stages):
            report = merged(name, [p['stages'][name] for p in per_piece], self.options.examples)
            if name == 'fuzzy':
                details = dict(fuzzy_details)
                report.seconds += details.pop('seconds', 0.0)
                report.details = {
                    'threshold': self.options.threshold,
                    'num_perm': self.options.num_perm,
                    'shingle_words': self.options.shingle_words,
                    **details,
                }
            stages_out.append(report)
        signatures = [self.work.read_json(f'signatures-{p["piece"]:05d}.json') for p in self.pieces]
        for report in stages_out:
            if report.name in ('exact', 'fuzzy'):
                report.seconds += sum(s[report.name] for s in signatures)
        return {
            'input': [s['path'] for s in scans],
            'output': self.output,
            'documents_in': self.documents,
            'bytes_in': stages_out[0].bytes_in,
            'documents_out': stages_out[-1].documents_out,
            # Decontamination cuts a document around its matches into pieces, a line each.
            'lines_out': sum(p['written'] for p in per_piece),
            'shards': len(self.pieces),
            'workers': self.options.workers,
            'seconds': round(seconds, 2),
            'peak_rss_main_mb': round(workdir.peak_rss_mb(), 1),
            'peak_rss_worker_mb': round(max(p['rss_mb'] for p in per_piece + signatures), 1),
            'stages': [r.as_dict() for r in stages_out],
        }


def _documents_of_edges(edges, earlier=None):
    """{'index', 'piece', 'size', 'hash'} of the documents at either end of `edges` (stages'
    edge columns) and in `earlier`, one row each, by index."""
    columns = {'index': [], 'piece': [], 'size': [], 'hash': []}
    for name, values in (earlier or {}).items():
        if len(values):  # (an empty int64 column would make the uint64 hashes float)
            columns[name].append(values)
    for end in ('a', 'b') if edges else ():
        columns['index'].append(edges[end])
        for name in ('piece', 'size', 'hash'):
            columns[name].append(edges[f'{name}_{end}'])
    joined = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in columns.items()}
    _, first = np.unique(joined['index'], return_index=True)
    return {k: v[first] for k, v in joined.items()}


# Rows of the removed table per map block of the filter stage's shuffle, which writes a file
# for each piece a block holds rows of: one block per piece and per exact file was 14,036
# objects on the driver with 3.2 GB's block counts when the shuffles were Ray Data's sorts.
REMOVED_BLOCK_ROWS = 1 << 18  # index, piece, kept: 6 MiB


def _removed(ray, undone, exact=None, fuzzy=None):
    """What the filter stage shuffles by piece, in a few blocks: one marker row for each piece
    in `undone` (so that a piece without duplicates is filtered too) and a row for each of
    their documents that the exact stage (its table in the folder `exact`) or fuzzy
    deduplication (`fuzzy`) removed."""
    wanted = np.array(undone)
    markers = [{'piece': p, 'index': -1, 'stage': 0, 'kept': -1, 'jaccard': np.nan}
               for p in undone]  # fmt: skip
    removed = ray.data.from_items(markers, override_num_blocks=1)
    for stage, folder in enumerate((exact, fuzzy)):
        if folder is not None:
            rows = functools.partial(_removed_rows, wanted=wanted, stage=stage)
            table = _read_back(ray, folder, columns=_REMOVED_COLUMNS[stage])
            batches = dict(batch_size=REMOVED_BLOCK_ROWS, batch_format='numpy')
            removed = removed.union(table.map_batches(rows, **batches))
    return removed


_REMOVED_COLUMNS = (['index', 'piece', 'kept'], None)  # the exact table's, the fuzzy one's


def _removed_rows(batch, wanted, stage):
    """The rows of `batch` (an exact stage's or the fuzzy removed table's) that remove a
    document of a piece in `wanted`, as _filter reads them."""
    keep = (batch['kept'] != batch['index']) & np.isin(batch['piece'], wanted)
    n = int(keep.sum())
    jaccard = batch['jaccard'][keep] if 'jaccard' in batch else np.full(n, np.nan)
    return {'piece': batch['piece'][keep], 'index': batch['index'][keep],
            'stage': np.full(n, stage, np.int64), 'kept': batch['kept'][keep],
            'jaccard': jaccard}  # fmt: skip


def _read_back(ray, folder, columns=None):
    """A stage's parquet files (their `columns`, or all) as a Dataset: one task a file, reading
    that file alone with pyarrow. Ray Data's read_parquet tasks grew with the stage's size at
    fixed partitions (237 -> 314 MB from a 100 MB to a 400 MB corpus; these: 249 -> 244 MB;
    docs/benchmarks.md)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith('.parquet'))
    names = ray.data.from_items(
        [{'file': os.path.join(folder, f)} for f in files], override_num_blocks=max(len(files), 1)
    )
    read = dict(batch_size=1, batch_format='pyarrow', fn_kwargs=dict(columns=columns))
    return names.map_batches(_read_file, **read)


def _read_file(batch, columns):
    import pyarrow.parquet as pq  # noqa: PLC0415 (a Ray worker's import)

    return pq.read_table(batch['file'][0].as_py(), columns=columns)


def _scan_task(path, keys, piece_bytes):
    try:
        return pieces_lib.scan(path, keys, piece_bytes)
    except InputError as e:
        return {'error': str(e)}


def curate(paths, output, options, work=None, address=None, identity=None):
    """Run the stages of `options` over the documents of `paths` into `output`; the report."""
    return Curation(paths, output, options, work, address, identity).run()
