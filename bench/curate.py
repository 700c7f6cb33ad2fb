"""Curation throughput (launch/curate.py): documents/s and MB/s per stage, peak memory.

    python bench/curate.py [--workers 2] [--synthetic-mb 200] [--no-synthetic]
    python bench/curate.py --only-ray | --only-memory [--memory-mb 200]   (part 3 / 3c alone)

1. Library or own code, on the default corpus (King James Bible + Python standard library,
   exported by launch/export_corpus.py): MinHash signatures with datasketch (integer shingle
   hashes through its 'affine32' permutations; and with its default SHA-1 of each shingle's
   bytes) against one numpy pass over all shingles; LSH candidate pairs with datasketch's
   MinHashLSH against one stable sort per band in numpy. The faster of each is what
   mtnlg_jax/data/curate uses.
2. The whole pipeline, run as `launch/curate.py` in a subprocess with --workers N, all four
   stages: exact, fuzzy (Jaccard 0.8), quality (Gopher's heuristics + a classifier whose
   reference is the Bible: a timing set-up, not a recommendation), decontamination (GPT-3's
   13-gram rule against 500 Bible verses as the "evaluation set"), on
   a. the default corpus (8 MB, as `make data` exports it), and
   b. a synthetic corpus of --synthetic-mb MB: documents of 20-60 random Bible verses, 10 %
      of them near copies (1 % of words replaced: Jaccard about 0.9), 5 % exact copies,
      10 % generated junk.
   Per stage: documents and MB in, compute seconds summed over the worker processes (and the
   main one's share: LSH, verification), and the rates per core they give. The classifier's
   threshold is 0.05 here: it still scores every document, but the set-up's reference and
   raw sample are both Bible text, so at 0.5 it would cut most of them at random and leave
   decontamination nothing to time (the tests check what it separates). Per run: wall
   seconds, documents/s and MB/s of the whole run, and the peak resident memory of the main
   process and of the largest worker (ru_maxrss).
3. On Ray (the engine since round four; data/ray_engine.py):
   a. start-up: ray.init(address='local') and a first trivial Ray Data job, in a fresh process;
   b. throughput per core, --workers 1 and 2, all four stages, on the synthetic corpus of
      --synthetic-mb (the 1x of c);
   c. peak resident memory of the driver and of the largest Ray worker process (sampled every
      20 ms over the run's whole process tree; Ray's own GCS, raylet and agents apart), and the
      largest LSH bucket, as the synthetic corpus grows 1x -> 4x -> 16x of --memory-mb; a
      worker's RSS counts the object store's shared pages it has read, so its private share
      (RSS less shared) is printed beside it. What one task holds is bounded by a shuffle
      partition (curate.py --part_documents, 20,000 documents): a corpus of fewer documents
      has smaller partitions, so --part-documents N shows the bound at a small --memory-mb.
Timings on a shared machine are noisy: read them as orders of magnitude.
"""

import argparse
import json
import threading
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from datasketch import MinHash  # noqa: E402
from datasketch.minhash import _fmix  # noqa: E402

from mtnlg_jax.data.corpus import bible_documents  # noqa: E402
from mtnlg_jax.data.curate import fuzzy  # noqa: E402
from mtnlg_jax.data.curate.text import words  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def own_signatures(shingle_sets, permutations, block=64):
    """Numpy MinHash over blocks of documents: one (shingles x num_perm) product, then a
    minimum per document (np.minimum.reduceat); datasketch's permutations, same result."""
    a, b = permutations
    out = []
    for start in range(0, len(shingle_sets), block):
        part = shingle_sets[start : start + block]
        lengths = np.array([len(s) for s in part])
        hashed = _fmix(np.concatenate(part).astype(np.uint32), 32)
        offsets = np.r_[0, np.cumsum(lengths)[:-1]]
        out.append(np.minimum.reduceat(hashed[:, None] * a + b, offsets, axis=0))
    return np.concatenate(out)


def sha1_signatures(texts, n=5):
    """datasketch as its documentation shows it: each shingle's bytes, SHA-1 hashed."""
    out = []
    for text in texts:
        w = words(text)
        sketch = MinHash(128)
        sketch.update_batch(
            [' '.join(w[i : i + n]).encode() for i in range(max(len(w) - n + 1, 1))]
        )
        out.append(sketch.hashvalues)
    return out


def library_or_own(texts):
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    shingle_sets, shingle_s = timed(lambda: [fuzzy.shingles(t, 5) for t in texts])
    signer = fuzzy.Signer()
    ours, library_s = timed(lambda: np.stack([signer(s) for s in shingle_sets]))
    own, own_s = timed(own_signatures, shingle_sets, signer.base.permutations)
    assert (own == ours).all()
    sample = texts[:300]
    _, sha1_s = timed(sha1_signatures, sample)
    sha1_s *= len(texts) / len(sample)
    keys = np.arange(len(texts))
    (pairs, _), numpy_lsh_s = timed(fuzzy.candidate_pairs, ours, keys, 0.8, 128)
    (reference, _), library_lsh_s = timed(fuzzy.candidate_pairs_datasketch, ours, keys, 0.8, 128)
    assert pairs == reference
    print(
        f'\n1. library or own code: default corpus, {len(texts):,} documents, {megabytes:.1f} MB, '
        f'{sum(map(len, shingle_sets)):,} shingles '
        f'(word 5-grams; hashing them: {shingle_s:.2f} s), '
        '128 permutations, one process'
    )
    rows = [
        ('MinHash signatures', 'datasketch, integer shingle hashes (used)', library_s),
        ('', 'own numpy (reduceat over blocks of 64 documents)', own_s),
        (
            '',
            "datasketch, its default SHA-1 of each shingle (+ shingling), est. from 300 docs",
            sha1_s,
        ),
        ('LSH candidate pairs', 'datasketch MinHashLSH (insert, read buckets)', library_lsh_s),
        ('', 'own numpy (one stable sort per band) (used)', numpy_lsh_s),
    ]
    print(f'   {"step":<20} {"implementation":<80} {"seconds":>8} {"docs/s":>9}')
    for step, name, seconds in rows:
        print(f'   {step:<20} {name:<80} {seconds:8.2f} {len(texts) / seconds:9,.0f}')
    print(f'   ({len(pairs)} candidate pairs, identical from both LSH implementations)')


def synthetic(path, megabytes, verses):
    """Write the synthetic corpus; returns its size in bytes."""
    rng, written, recent = random.Random(0), 0, []
    junk_words = ['cheap', 'casino', 'bonus', 'click', 'free', 'win', 'deal', 'now', '|', 'Home']
    with open(path, 'w') as f:
        while written < megabytes * 1e6:
            kind = rng.random()
            if kind < 0.05 and recent:
                text = rng.choice(recent)
            elif kind < 0.15 and recent:
                w = rng.choice(recent).split(' ')
                for i in rng.sample(range(len(w)), max(1, len(w) // 100)):
                    w[i] = rng.choice(verses).split(' ')[0]
                text = ' '.join(w)
            elif kind < 0.25:
                text = ' '.join(rng.choices(junk_words, k=rng.randint(100, 800)))
            else:
                text = '\n'.join(rng.choices(verses, k=rng.randint(20, 60)))
                recent = (recent + [text])[-1000:]
            line = json.dumps({'text': text}) + '\n'
            f.write(line)
            written += len(line.encode())
    return written


def _sampled_peaks(process, stop, peaks):
    """Peak RSS (MB) per role of `process` and its descendants until `stop` is set, and per
    role + '_private' the peak of RSS less its shared pages (a Ray worker maps the object
    store's shared memory: the blocks it reads count in its RSS, not in its own heap).

    Every 20 ms: a task's peak can last well under a few tenths of a second, and a coarser
    sampler misses it more often on a small corpus, whose tasks are short (docs/benchmarks.md,
    curation memory). Each process is classified once, when first seen (its name and command
    line are slow to read)."""
    import psutil

    roles, found = {}, 0.0
    while not stop.is_set():
        if time.monotonic() - found > 0.5:  # new processes: Ray starts workers as it goes
            found = time.monotonic()
            try:
                tree = [process] + process.children(recursive=True)
            except psutil.Error:
                break
            for p in tree:
                if p.pid not in roles:
                    try:
                        roles[p.pid] = (p, _role(p, process.pid))
                    except psutil.Error:
                        continue
        for pid, (p, role) in list(roles.items()):
            try:
                memory = p.memory_info()
            except psutil.Error:
                roles.pop(pid)
                continue
            rss, private = memory.rss / 2**20, (memory.rss - memory.shared) / 2**20
            peaks[role] = max(peaks.get(role, 0.0), rss)
            peaks[role + '_private'] = max(peaks.get(role + '_private', 0.0), private)
        stop.wait(0.02)


def _role(p, driver_pid):
    """'driver', 'worker' (a Ray worker) or 'ray' (Ray's own processes) of a psutil.Process."""
    if p.pid == driver_pid:
        return 'driver'
    name, cmdline = p.name(), ' '.join(p.cmdline()[:3])
    if name in ('gcs_server', 'raylet') or 'Agent' in name or 'agent' in cmdline:
        return 'ray'
    return 'worker' if 'default_worker' in cmdline or name.startswith('ray::') else 'ray'


def run_pipeline(name, inputs, folder, workers, reference, evaluation, quiet=False, extra=()):
    output = os.path.join(folder, f'{name}.curated.jsonl')
    command = [
        sys.executable,
        os.path.join(ROOT, 'launch/curate.py'),
        '--input',
        *inputs,
        '--output',
        output,
        '--workers',
        str(workers),
        '--quality_reference',
        reference,
        '--classifier_threshold',
        '0.05',
        '--eval',
        evaluation,
        *extra,
    ]
    import psutil

    start, stop, peaks = time.perf_counter(), threading.Event(), {}
    child = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, 'PYTHONPATH': ROOT},
    )
    sampler = threading.Thread(target=_sampled_peaks, args=(psutil.Process(child.pid), stop, peaks))
    sampler.start()
    assert child.wait() == 0, command
    stop.set()
    sampler.join()
    wall = time.perf_counter() - start
    report = json.load(open(os.path.join(folder, f'{name}.curated.report.json')))
    report['wall'], report['peaks'] = wall, peaks
    if quiet:
        return report
    mb = report['bytes_in'] / 1e6
    print(
        f'\n2{name[0]}. {name} (load average {os.getloadavg()[0]:.1f} at the end): '
        f'{report["documents_in"]:,} documents, {mb:.1f} MB, '
        f'--workers {workers}: {wall:.1f} s wall (with start-up and the classifier\'s training) '
        f'= {report["documents_in"] / wall:,.0f} documents/s, {mb / wall:.2f} MB/s; '
        f'{report["documents_out"]:,} documents out; '
        f'peak RSS main {report["peak_rss_main_mb"]:.0f} MB, '
        f'largest worker {report["peak_rss_worker_mb"]:.0f} MB'
    )
    print(
        f'    {"stage":<14} {"docs in":>9} {"MB in":>8} {"removed":>15} {"compute s":>10} '
        f'{"docs/s/core":>12} {"MB/s/core":>10}'
    )
    for s in report['stages']:
        seconds = max(s['seconds'], 1e-9)
        removed = (
            f"{s['documents_removed']:,} ({s['documents_removed'] / max(s['documents_in'], 1):.1%})"
        )
        print(
            f"    {s['stage']:<14} {s['documents_in']:>9,} {s['bytes_in'] / 1e6:>8.1f} "
            f"{removed:>15} "
            f"{s['seconds']:>10.1f} {s['documents_in'] / seconds:>12,.0f} "
            f"{s['bytes_in'] / 1e6 / seconds:>10.2f}"
        )
    return report


def ray_start_up():
    """Seconds to ray.init(address='local') and to a first trivial Ray Data job."""
    code = (
        'import time; t = time.perf_counter()\n'
        'from mtnlg_jax.data import ray_engine\n'
        'with ray_engine.started(2) as ray:\n'
        '    up = time.perf_counter() - t\n'
        '    ray.data.range(10).map_batches(lambda b: b).materialize()\n'
        '    print(up, time.perf_counter() - t)\n'
    )
    done = subprocess.run(
        [sys.executable, '-c', code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, 'PYTHONPATH': ROOT},
    )
    return [float(x) for x in done.stdout.split()[-2:]]


def ray_throughput(args, folder, verses, reference, evaluation):
    up, first = ray_start_up()
    print(f'\n3a. Ray start-up: ray.init {up:.1f} s; with a first Ray Data job {first:.1f} s')
    path = os.path.join(folder, 'synthetic.jsonl')
    if not os.path.exists(path):
        synthetic(path, args.synthetic_mb, verses)
    print('\n3b. throughput per core, all four stages, synthetic corpus')
    print('    | workers | MB | wall s | compute s (stages) | MB/s per core | MB/s wall |')
    for workers in (1, 2):
        r = run_pipeline(f'ray{workers}', [path], folder, workers, reference, evaluation, True)
        mb, compute = r['bytes_in'] / 1e6, sum(s['seconds'] for s in r['stages'])
        print(f'    | {workers} | {mb:.0f} | {r["wall"]:.0f} | {compute:.0f} | '
              f'{mb / compute:.2f} | {mb / r["wall"]:.2f} |')  # fmt: skip


def ray_rows(args, folder, verses, reference, evaluation):
    if not args.only_memory:
        ray_throughput(args, folder, verses, reference, evaluation)
    print('\n3c. peak resident memory as the corpus grows (MB; private: less shared pages)')
    print('    | corpus | MB | documents | driver | driver, private | largest worker '
          '| largest worker, private | Ray (GCS, raylet, agents) | largest bucket '
          '| wall s |')  # fmt: skip
    for scale in (1, 4, 16):
        scaled = os.path.join(folder, f'memory{scale}.jsonl')
        synthetic(scaled, args.memory_mb * scale, verses)
        extra = ('--part_documents', str(args.part_documents)) if args.part_documents else ()
        r = run_pipeline(f'memory{scale}', [scaled], folder, 2, reference, evaluation, True, extra)
        fuzzy_stage = next(s for s in r['stages'] if s['stage'] == 'fuzzy')
        p = r['peaks']
        print(f'    | {scale}x | {r["bytes_in"] / 1e6:.0f} | {r["documents_in"]:,} | '
              f'{p.get("driver", 0):.0f} | {p.get("driver_private", 0):.0f} | '
              f'{p.get("worker", 0):.0f} | '
              f'{p.get("worker_private", 0):.0f} | {p.get("ray", 0):.0f} | '
              f'{fuzzy_stage["largest_bucket"]} | {r["wall"]:.0f} |')  # fmt: skip
        os.remove(scaled)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--synthetic-mb', type=float, default=200)
    parser.add_argument('--no-synthetic', action='store_true')
    parser.add_argument('--memory-mb', type=float, default=200, help='the 1x of part 3c')
    parser.add_argument('--only-ray', action='store_true', help='part 3 alone')
    parser.add_argument('--only-memory', action='store_true', help='part 3c alone')
    parser.add_argument(
        '--part-documents', type=int, default=0, help="3c: curate.py's --part_documents"
    )
    args = parser.parse_args()
    print(f'command: python bench/curate.py {" ".join(sys.argv[1:])}'.strip())
    print(
        f'machine: {os.cpu_count()} cores, shared with other work (load average '
        f'{os.getloadavg()[0]:.1f} at start): timings are noisy; compute seconds are CPU time'
    )
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, os.path.join(ROOT, 'launch/export_corpus.py'), '--out', folder],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, 'PYTHONPATH': ROOT},
        )
        inputs = [os.path.join(folder, f'{s}.jsonl') for s in ('kjv', 'python_stdlib')]
        verses = [v for chapter in bible_documents() for v in chapter.split('\n')[1:] if v]
        rng = random.Random(1)
        evaluation = os.path.join(folder, 'evaluation.jsonl')
        with open(evaluation, 'w') as f:
            f.writelines(json.dumps({'text': v}) + '\n' for v in rng.sample(verses, 500))
        if args.only_ray or args.only_memory:
            ray_rows(args, folder, verses, inputs[0], evaluation)
            return
        texts = [json.loads(line)['text'] for path in inputs for line in open(path)]
        library_or_own(texts)
        run_pipeline('default corpus', inputs, folder, args.workers, inputs[0], evaluation)
        if not args.no_synthetic:
            path = os.path.join(folder, 'synthetic.jsonl')
            size, seconds = timed(synthetic, path, args.synthetic_mb, verses)
            print(f'\n(synthetic corpus: {size / 1e6:.0f} MB written in {seconds:.0f} s)')
            run_pipeline('synthetic corpus', [path], folder, args.workers, inputs[0], evaluation)
        ray_rows(args, folder, verses, inputs[0], evaluation)


if __name__ == '__main__':
    main()
