"""Curation and preprocessing on Ray: the golden outputs of the engine before Ray
(tests/fixtures/curation, made by make_golden.py) byte for byte from an embedded Ray and from a
cluster started apart with token authentication; shards, resume, a killed worker, bad input;
fuzzy deduplication's per-bucket edges against the one-process clusters.

One embedded Ray (this process) and one head started here (`ray start --head --block` on
127.0.0.1, free ports, a small object store, ended by its process id) serve every test.
"""

import functools
import importlib
import json
import logging
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import support
from mtnlg_jax.data import ray_engine
from mtnlg_jax.data.curate import engine, fuzzy, pipeline, quality, shuffle, stages
from mtnlg_jax.data.preprocess import InputError

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / 'tests/fixtures/curation'
RAY = pathlib.Path(sys.executable).parent / 'ray'
sys.path.insert(0, str(GOLDEN))
PLANTED = ('--quality_reference', GOLDEN / 'good.jsonl', '--eval', GOLDEN / 'eval.jsonl',
           '--min_words', '10')  # fmt: skip


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    """A Ray head started apart, token authentication on: (address, the env that joins it)."""
    token = os.urandom(16).hex()
    env = {**os.environ, 'RAY_AUTH_MODE': 'token', 'RAY_AUTH_TOKEN': token,
           'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0', 'PYTHONPATH': str(ROOT)}  # fmt: skip
    port = free_port()
    head = subprocess.Popen(
        [RAY, 'start', '--head', '--block', '--node-ip-address', '127.0.0.1', '--port', str(port),
         '--num-cpus', '2', '--object-store-memory', str(80 << 20), '--include-dashboard',
         'false', '--disable-usage-stats', '--temp-dir', str(tmp_path_factory.mktemp('ray'))],
        # SIGTERM ends it at once, without the drain first (meant for Serve's proxies on
        # Kubernetes): with this module's idle workers a drain runs its whole 30 s allowance.
        env={**env, 'RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S': '0'},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    address, waited = f'127.0.0.1:{port}', time.monotonic()
    while True:  # a loaded machine can take minutes
        try:
            ray_engine.check_address(address)
            break
        except InputError:
            if head.poll() is not None or time.monotonic() - waited > 600:
                pytest.fail(f'the Ray head did not start (exit status {head.poll()})')
            time.sleep(0.5)
    yield address, env
    head.terminate()
    head.wait(60)


@pytest.fixture(scope='module')
def embedded():
    """The embedded Ray of ray_engine.started, kept up for this module's in-process runs."""
    with ray_engine.started(2, object_store_mb=80) as ray:
        yield ray


def tool(name, *args, env=None, beside=None):
    """launch/NAME ARGS to its end; `beside(stopped)`, if given, runs in a thread meanwhile."""
    command = [sys.executable, str(ROOT / 'launch' / name), *map(str, args)]
    env = env or {**os.environ, 'PYTHONPATH': str(ROOT)}
    stopped = threading.Event()
    thread = threading.Thread(target=beside, args=(stopped,), daemon=True) if beside else None
    if thread:
        thread.start()
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    finally:
        stopped.set()
        if thread:
            thread.join()


def concatenated(folder):
    manifest = json.loads((folder / 'manifest.json').read_text())
    return b''.join((folder / s['file']).read_bytes() for s in manifest['shards'])


def test_a_cluster_joined_with_its_token_writes_the_golden_shards_and_tokens(cluster, tmp_path):
    """2 workers, pieces of 16 kB (10 shards), partitions of 7 documents, a worker killed
    in pass 1: the shards concatenate to the golden curated file, and their tokens (one
    .bin/.idx per shard, and the merged prefix) to the golden tokens."""
    address, env = cluster
    out = tmp_path / 'curated'
    done = tool('curate.py', '--input', GOLDEN / 'planted.raw.jsonl', '--output', f'{out}/',
                '--workers', 2, '--ray_address', address, '--shard_mb', 1 / 64,
                '--part_documents', 7, '--drill', 'signatures', *PLANTED, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / 'manifest.json').read_text())
    assert len(manifest['shards']) >= 8 and manifest['inputs'][0]['sha256']
    assert concatenated(out) == (GOLDEN / 'planted.jsonl').read_bytes()
    golden = importlib.import_module('make_golden')  # tests/fixtures/curation
    assert golden.comparable(json.loads((out / 'report.json').read_text())) == golden.comparable(
        json.loads((GOLDEN / 'planted.report.json').read_text())
    )
    assert not (tmp_path / 'curated.work').exists()
    prefix = tmp_path / 'tokens'
    done = tool('preprocess.py', '--input', out, '--tokenizer-model',
                GOLDEN / 'planted.tokenizer.model', '--output-prefix', prefix, '--append-eod',
                '--workers', 2, '--ray_address', address, '--piece-mb', 1 / 64,
                env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for suffix in ('.bin', '.idx'):
        golden = (GOLDEN / f'planted{suffix}').read_bytes()
        assert pathlib.Path(f'{prefix}{suffix}').read_bytes() == golden
    shards = sorted(pathlib.Path(f'{prefix}.shards').glob('part-*.bin'))
    assert len(shards) == len(manifest['shards'])
    assert b''.join(s.read_bytes() for s in shards) == (GOLDEN / 'planted.bin').read_bytes()


def test_the_embedded_ray_listens_on_loopback_only(embedded):
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [
        c.laddr.ip
        for c in psutil.net_connections('inet')
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    ]
    assert listening and set(listening) <= {'127.0.0.1', '::ffff:127.0.0.1', '::1'}, listening


def test_ray_datas_warning_of_a_hang_between_jobs_is_not_shown(embedded, caplog):
    """Its "no available CPUs" line, printed when a job starts while the last one's tasks
    still hold the CPUs, is dropped; Ray Data's other warnings are not."""
    logger = logging.getLogger('ray.data.dataset')
    logger.warning('Warning: The Ray cluster currently does not have any available CPUs.')
    logger.warning('another warning')
    assert [r.getMessage() for r in caplog.records] == ['another warning']


def test_ray_workers_run_with_the_allocator_settings_that_give_memory_back(embedded):
    @embedded.remote
    def settings():
        import pyarrow

        names = ray_engine.WORKER_ENV
        return pyarrow.default_memory_pool().backend_name, {k: os.environ.get(k) for k in names}

    backend, environment = embedded.get(settings.remote())
    assert environment == ray_engine._worker_env()
    assert backend == environment['ARROW_DEFAULT_MEMORY_POOL']


def test_a_grouping_gives_each_shuffle_task_one_group_whole(embedded, tmp_path):
    """shuffle.grouped over blocks that each hold every key, with Ray Data's blocks capped far
    below a group's size: fn sees each key once, whole; a key between two values goes with the
    lower value's task, still apart from it; a map task run again (retried after it wrote
    part of its files) adds no rows."""
    rows = [{'k': i % 5, 'v': i} for i in range(2000)] + [{'k': 9, 'v': 2000}]
    data = embedded.data.from_items(rows, override_num_blocks=3)
    values = [0, 1, 2, 4, 9]  # 3 goes with 2

    def group_facts(batch):
        return {'key': batch['k'][:1], 'rows': [len(batch['k'])], 'keys': [len(set(batch['k']))],
                'sum': [int(batch['v'].sum())]}  # fmt: skip

    context = embedded.data.DataContext.get_current()
    saved, context.target_max_block_size = context.target_max_block_size, 1024
    try:
        facts = shuffle.grouped(data, 'k', values, group_facts, str(tmp_path / 'a')).take_all()
    finally:
        context.target_max_block_size = saved
    sums = [sum(range(k, 2000, 5)) for k in range(5)] + [2000]
    assert sorted((f['key'], f['rows'], f['keys'], f['sum']) for f in facts) == [
        (k, 400 if k < 9 else 1, 1, s) for k, s in zip([0, 1, 2, 3, 4, 9], sums)]  # fmt: skip
    import pyarrow as pa

    table = pa.table({'k': np.array([1, 1, 2, 9]), 'v': np.array([5, 6, 7, 8])})
    spill = dict(key='k', values=np.array(values), folder=str(tmp_path / 'b'))
    for _ in range(2):
        shuffle._spill(table, **spill)
    gather = dict(key='k', folder=str(tmp_path / 'b'), fn=group_facts, fn_kwargs={})
    once = [f for v in values for f in shuffle._gather({'k': np.array([v])}, **gather)]
    assert [(int(f['key'][0]), f['rows'], f['sum']) for f in once] == [
        (1, [2], [11]), (2, [1], [7]), (9, [1], [8])]  # fmt: skip


def test_the_filter_stage_shuffles_a_few_blocks_however_many_files_and_pieces(embedded, tmp_path):
    """engine._removed: the exact table's 40 files (a column it does not need beside) and the
    fuzzy table, for 30 pieces of which one is done already, come to the shuffle as at most
    three blocks (each map block is one object per piece on the driver), holding one marker per
    piece to do and each removed document of those pieces, once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / 'exact')
    exact_rows = []
    for f in range(40):
        index = np.arange(f * 50, (f + 1) * 50)
        kept = np.where(rng.random(50) < 0.2, index - 1, index)
        table = {'index': index, 'piece': index % 30, 'kept': kept, 'sig': rng.random((50, 4))}
        exact_rows += [(0, i, p, k) for i, p, k in zip(index, index % 30, kept) if k != i]
        pq.write_table(pa.table({**table, 'sig': list(table['sig'])}),
                       tmp_path / 'exact' / f'{f:03d}.parquet')  # fmt: skip
    os.makedirs(tmp_path / 'fuzzy')
    fuzzy = {'index': np.array([3, 64, 95]), 'piece': np.array([3, 4, 5]),
             'kept': np.array([2, 60, 90]), 'jaccard': np.array([0.9, 0.8, 0.85])}  # fmt: skip
    pq.write_table(pa.table(fuzzy), tmp_path / 'fuzzy' / 'removed.parquet')
    undone = [p for p in range(30) if p != 7]
    removed = engine._removed(
        embedded, undone, exact=str(tmp_path / 'exact'), fuzzy=str(tmp_path / 'fuzzy')
    ).materialize()
    assert removed.num_blocks() <= 3
    got = sorted((r['stage'], r['index'], r['piece'], r['kept']) for r in removed.take_all())
    expected = [(0, -1, p, -1) for p in undone] + [r for r in exact_rows if r[2] != 7]
    expected += [(1, *r) for r in zip(fuzzy['index'], fuzzy['piece'], fuzzy['kept'])]
    assert got == sorted(expected)


@functools.lru_cache(maxsize=None)
def _planted_classifier():
    """PLANTED's classifier, trained once a process (3 s)."""
    good = [json.loads(line)['text'] for line in open(GOLDEN / 'good.jsonl')]
    raw = [json.loads(line)['text'] for line in open(GOLDEN / 'planted.raw.jsonl')]
    return quality.Classifier().fit(good, quality.sample_by_hash(raw, 5000))


def _planted_options(**changes):
    from mtnlg_jax.data.curate import decontaminate

    options = pipeline.Options(
        stages=pipeline.STAGES,
        rules=quality.Rules(min_words=10),
        classifier=_planted_classifier(),
        contaminants=decontaminate.contaminants(
            decontaminate.evaluation_texts([str(GOLDEN / 'eval.jsonl')])
        ),
    )
    for key, value in changes.items():
        setattr(options, key, value)
    return options


def test_a_rerun_resumes_from_the_work_folder_and_refuses_other_options(embedded, tmp_path):
    """One worker, pieces of 32 kB: a run dies after its last stage; a rerun with another
    threshold is refused; the same rerun writes only what was missing: the golden file."""
    raw, work = str(GOLDEN / 'planted.raw.jsonl'), tmp_path / 'work'
    options = _planted_options(workers=1, shard_mb=1 / 32)
    run = engine.Curation([raw], str(tmp_path / 'out.jsonl'), options, str(work))
    original = run._filter
    run._filter = lambda *a: (original(*a), exec('raise KeyboardInterrupt'))  # dies at the end
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert (work / 'fuzzy.done').exists() and not (tmp_path / 'out.jsonl').exists()
    changed = _planted_options(workers=1, shard_mb=1 / 32, threshold=0.7)
    with pytest.raises(InputError, match='work_dir .*other options .*threshold'):
        engine.curate([raw], str(tmp_path / 'out.jsonl'), changed, str(work))
    parts = {p: p.stat().st_mtime_ns for p in (work / 'parts').glob('*.jsonl')}
    engine.curate([raw], str(tmp_path / 'out.jsonl'), options, str(work))
    assert parts and all(p.stat().st_mtime_ns == t for p, t in parts.items() if p.exists())
    assert (tmp_path / 'out.jsonl').read_bytes() == (GOLDEN / 'planted.jsonl').read_bytes()
    assert not work.exists()


@pytest.mark.parametrize(
    'content, message',
    [
        (b'{"text": "a"}\n' * 50 + b'not json\n' + b'{"text": "b"}\n', 'bad.jsonl:51: not a JSON'),
        (b'{"text": "a"}\n{"text": "caf\xe9"}\n', 'not UTF-8 text'),
        (b'\n{"text": ""}\n', 'no documents'),
    ],
)
def test_a_bad_line_anywhere_is_one_error_line_before_anything_is_written(
    embedded, tmp_path, capsys, monkeypatch, content, message
):
    """launch/curate.py's main in this process, on the embedded Ray (its command line:
    test_command_line_contract.py)."""
    (tmp_path / 'bad.jsonl').write_bytes(content)
    output = tmp_path / 'curated.jsonl'
    output.write_text('earlier output\n')
    status, _, errors = support.launch_in_process(
        'curate', capsys, monkeypatch, '--input', tmp_path / 'bad.jsonl', '--output', output
    )
    assert status == 2 and len(errors) == 1, errors
    assert errors[0].startswith('error: ') and message in errors[0]
    assert output.read_text() == 'earlier output\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['bad.jsonl', 'curated.jsonl']


def test_a_document_cut_around_a_match_counts_once_and_its_pieces_as_lines(
    embedded, tmp_path, capsys, monkeypatch
):
    """Decontamination cuts a document into two lines: the report, the manifest and the
    closing line count it as one document kept, and its pieces as lines."""
    from test_curate_decontaminate import ITEM, filler

    texts = [f'{filler(0, 1000)} {ITEM} {filler(1, 1000)}', filler(2, 1500)]
    (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts))
    (tmp_path / 'eval.jsonl').write_text(json.dumps({'text': ITEM}) + '\n')
    out = tmp_path / 'out'
    status, printed, errors = support.launch_in_process(
        'curate', capsys, monkeypatch, '--input', tmp_path / 'in.jsonl', '--output', f'{out}/',
        '--stages', 'decontaminate', '--eval', tmp_path / 'eval.jsonl',
    )  # fmt: skip
    assert status == 0, errors
    manifest = json.loads((out / 'manifest.json').read_text())
    report = json.loads((out / 'report.json').read_text())
    lines = sum(len((out / s['file']).read_text().splitlines()) for s in manifest['shards'])
    assert (report['documents_out'], report['lines_out'], lines) == (2, 3, 3)
    assert [(s['documents_out'], s['lines']) for s in manifest['shards']] == [(2, 3)]
    assert (manifest['documents_out'], manifest['lines_out']) == (2, 3)
    assert '2 of 2 documents as 3 lines (cut around evaluation matches)' in printed


def test_an_unreachable_address_is_one_error_line(tmp_path):
    (tmp_path / 'ok.jsonl').write_text('{"text": "a"}\n')
    address = f'127.0.0.1:{free_port()}'
    done = tool('curate.py', '--input', tmp_path / 'ok.jsonl', '--output', tmp_path / 'o.jsonl',
                '--ray_address', address)  # fmt: skip
    assert done.returncode == 2 and done.stderr == f'error: --ray_address {address}: ' + (
        'unreachable (Connection refused)\n'
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ok.jsonl']


def _partitioned(batch, parts, rng):
    """A batch cut at random into `parts` partitions by its 'part' column, shuffled rows."""
    for p in range(parts):
        rows = np.flatnonzero(batch['part'] % parts == p)
        rng.shuffle(rows)
        if len(rows):
            yield {k: v[rows] for k, v in batch.items()}


@pytest.mark.parametrize('seed', range(6))
def test_components_of_per_bucket_edges_equal_the_one_process_clusters(seed):
    """Random near-copy families of short random documents (some shorter than a shingle):
    the band-keyed shuffle, per-bucket verification and the spanning forest of the edges, fed
    a partition at a time, give the clusters of fuzzy.candidate_pairs + fuzzy.clusters."""
    rng = random.Random(seed)
    words = [f'w{i}' for i in range(60)]
    docs = []
    for _ in range(40):
        base = rng.choices(words, k=rng.randint(2, 30))
        docs.append(base)
        for _ in range(rng.randint(0, 3)):
            copy = list(base)
            for i in rng.sample(range(len(copy)), rng.randint(0, max(len(copy) // 6, 1))):
                copy[i] = rng.choice(words)
            docs.append(copy)
    texts = [' '.join(d) for d in docs]
    shingle_sets = {i: fuzzy.shingles(t, 5) for i, t in enumerate(texts)}
    signer = fuzzy.Signer(128, 1)
    signatures = np.stack([signer(shingle_sets[i]) for i in range(len(texts))])
    threshold = 0.6
    pairs, (bands, rows) = fuzzy.candidate_pairs(signatures, np.arange(len(texts)), threshold, 128)
    expected, _, joined = fuzzy.clusters(pairs, shingle_sets, threshold)
    n, parts, np_rng = len(texts), rng.randint(1, 5), np.random.default_rng(seed)
    batch = {'index': np.arange(n), 'piece': np.arange(n) // 7, 'size': np.ones(n, np.int64),
             'hash': np.arange(n, dtype=np.uint64), 'sig': signatures,
             'kept': np.arange(n)}  # fmt: skip
    banded = stages.band_rows(batch, bands, rows, parts)
    members = [stages.bucket_members(b) for b in _partitioned(banded, parts, np_rng)]
    members = {k: np.concatenate([m[k] for m in members]) for k in members[0]}
    members['shingles'] = np.array(
        [shingle_sets[i].tobytes() for i in members['index']] + [b''], object
    )[:-1]
    forest = fuzzy.EdgeForest()  # fed one partition's verified edges at a time
    for part in _partitioned(members, parts, np_rng):
        edges = stages.verified_edges(part, threshold)
        real = edges['a'] >= 0
        forest.add(edges['a'][real], edges['b'][real], edges['jaccard'][real])
    nodes, labels, first = forest.components()
    groups = {}
    for node, label in zip(nodes.tolist(), labels):
        groups.setdefault(label, []).append(node)
    assert sorted(groups.values()) == sorted(expected)
    assert len(expected) >= 5
    assert len(forest.a) == len(nodes) - len(groups)  # a forest: what the driver holds
    # Each document's similarity is that of the first edge (in pair order) that joined it.
    joined_first = {}
    for (x, y), value in joined.items():
        joined_first.setdefault(x, value)
        joined_first.setdefault(y, value)
    assert dict(zip(nodes.tolist(), first.tolist())) == joined_first


def test_the_cluster_recipe_turns_token_authentication_on():
    recipe = (ROOT / 'launch/slurm/curate.sbatch').read_text()
    assert 'RAY_AUTH_MODE=token' in recipe and 'RAY_AUTH_TOKEN' in recipe
    assert 'ray symmetric-run' in recipe or 'ray start --head' in recipe
    shutil.which('bash') and subprocess.run(['bash', '-n', ROOT / 'launch/slurm/curate.sbatch'],
                                            check=True)  # fmt: skip


def one_process_survivors(texts, threshold):
    """Exact and fuzzy deduplication in this process with the pure functions (the rule the
    engine before Ray ran): the surviving texts, in input order."""
    from mtnlg_jax.data.curate import exact

    sizes = np.array([len(t.encode()) for t in texts], np.int64)
    hashes = np.array([exact.content_hash(t) for t in texts], np.uint64)
    removed, _ = exact.duplicates(np.stack([exact.fingerprint(t) for t in texts]), sizes, hashes)
    alive = np.flatnonzero(~removed)
    signer = fuzzy.Signer()
    shingle_sets = {int(i): fuzzy.shingles(texts[i], 5) for i in alive}
    signatures = np.stack([signer(shingle_sets[int(i)]) for i in alive])
    pairs, _ = fuzzy.candidate_pairs(signatures, alive, threshold, 128)
    groups, _, _ = fuzzy.clusters(pairs, shingle_sets, threshold)
    gone = set(fuzzy.kept_of_clusters(groups, sizes, hashes))
    return [texts[i] for i in alive if int(i) not in gone]


@pytest.fixture(scope='module')
def planted_pairs_run(embedded, tmp_path_factory):
    """test_curate_fuzzy's planted pairs, shuffled, curated with 2 workers, 5 pieces and
    partitions of 50 documents: (texts, kept, report)."""
    from test_curate_fuzzy import THRESHOLD, planted_documents

    docs, pairs, exact_pairs = planted_documents()
    shuffled = list(docs)
    random.Random(1).shuffle(shuffled)
    folder = tmp_path_factory.mktemp('pairs')
    source = folder / 'in.jsonl'
    source.write_text(''.join(json.dumps({'text': d}) + '\n' for d in shuffled))
    options = pipeline.Options(
        stages=('exact', 'fuzzy'), threshold=THRESHOLD, workers=2, shard_mb=0.03,
        part_documents=50,
    )  # fmt: skip
    report = engine.curate([str(source)], str(folder / 'out.jsonl'), options)
    kept = [json.loads(line)['text'] for line in open(folder / 'out.jsonl')]
    return shuffled, kept, report, pairs, exact_pairs, THRESHOLD


def test_recall_and_precision_against_exact_jaccard(planted_pairs_run):
    _, kept, report, pairs, exact_pairs, threshold = planted_pairs_run
    kept = set(kept)
    above = [(a, b) for a, b, j in pairs if j >= threshold]
    assert 30 <= len(above) <= 170  # both sides of the threshold are well represented
    recall = sum((a in kept) != (b in kept) for a, b in above) / len(above)
    # Removed documents whose pair is truly below the threshold are false positives.
    removed = [(a, b, j) for a, b, j in pairs if not (a in kept and b in kept)]
    precision = sum(j >= threshold for _, _, j in removed) / max(len(removed), 1)
    assert recall >= 0.95 and precision >= 0.95, (recall, precision)
    assert all(a in kept or b in kept for a, b, _ in pairs)  # never both removed
    assert all((a in kept) + (b in kept) == 1 for a, b in exact_pairs)  # exact: one of two
    stages_by_name = {s['stage']: s for s in report['stages']}
    assert stages_by_name['exact']['documents_removed'] == len(exact_pairs)
    assert stages_by_name['fuzzy']['documents_out'] == len(kept)
    assert stages_by_name['fuzzy']['bands'] * stages_by_name['fuzzy']['rows'] <= 128


def test_sharded_partitioned_survivors_equal_the_one_process_rule(planted_pairs_run):
    shuffled, kept, report, _, _, threshold = planted_pairs_run
    assert report['workers'] == 2 and report['shards'] >= 5
    assert kept == one_process_survivors(shuffled, threshold)  # the same, in input order


def test_a_hung_worker_ends_the_run_with_one_line_and_keeps_the_work(cluster, tmp_path):
    """--drill stall: piece 0's worker hangs in pass 1; with --stall_timeout_s 5 the run ends
    with status 3 and one `error:` line naming the stage, no output placed, the work folder
    (its scan and state) kept for a rerun. The deduplication stages alone: the hang is in
    their pass 1, before the classifier (trained in the driver first, 3 s) or the evaluation
    n-grams would be used. Until the worker hangs the test touches the
    heartbeat itself, from the scan on: on CI's loaded cores a Ray worker's start can take
    longer than any bound a test can wait, and a watch that fires then (the failure it is
    also for) is not this drill's. Last in the module: the hung worker holds a CPU of the
    cluster until Ray ends the departed driver's job."""
    address, env = cluster
    out = tmp_path / 'curated.jsonl'
    work = tmp_path / 'curated.jsonl.work'

    work.mkdir()  # the watch reads its heartbeat from the scan on (curate takes the folder)

    def until_the_worker_hangs(stopped):
        while not (work / 'drill.stall').exists() and not stopped.wait(1.0):
            (work / '.heartbeat').touch()

    started = time.monotonic()
    done = tool('curate.py', '--input', GOLDEN / 'planted.raw.jsonl', '--output', out,
                '--workers', 2, '--ray_address', address, '--shard_mb', 1 / 64,
                '--drill', 'stall', '--stall_timeout_s', 5, '--stages', 'exact', 'fuzzy',
                env=env,
                beside=until_the_worker_hangs)  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert time.monotonic() - started < 300
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith('error: curate: no progress for ') and 'signatures' in lines[-1]
    assert [line for line in lines if line.startswith('error:')] == lines[-1:]
    assert (work / 'drill.stall').exists()  # piece 0's worker did hang (not fail otherwise)
    assert not out.exists() and (work / 'state.json').exists()
