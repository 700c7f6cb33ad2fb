"""Data throughput: preprocessing (tokens/s) and the loader (samples/s) against what training eats.

    python bench/data.py [--batches 20]

1. Preprocessing: the default corpus (King James Bible + Python standard library, exported to
   jsonl in a temporary folder) through launch/preprocess.py's code with 1 and 2 workers; the
   seconds include starting the worker processes (spawned: each imports sentencepiece anew).
2. Loader: the two sources blended 0.5 / 0.5 at the sequence length and global batch of the
   tiny and gpt2_124m configs; samples/s of the host read alone (blend.samples) and of whole
   batches placed on the config's 8-device mesh by the prefetching TrainBatches.
   "a step consumes" is global batch / step time: for tiny the step is measured here (layout
   4 x 1 x 2, as bench/throughput.py); a gpt2_124m step cannot run on this CPU, so its figure is
   an estimate for 8 H100s at 40 % MFU (989 TFLOP/s bf16 peak, 6N + 12LHQT FLOPs per token).
Headroom = loader samples/s / samples/s a step consumes: above 1 the loader keeps up.
"""

import argparse
import json
import os
import sys
import tempfile
import time

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import throughput  # noqa: E402
from mtnlg_jax import config as config_lib  # noqa: E402
from mtnlg_jax.model import counts  # noqa: E402
from mtnlg_jax.data import loader as loader_lib  # noqa: E402
from mtnlg_jax.data.corpus import default_sources  # noqa: E402
from mtnlg_jax.data.preprocess import tokenize  # noqa: E402
from mtnlg_jax.data.tokenizer import Tokenizer  # noqa: E402
from mtnlg_jax.model import gpt  # noqa: E402
from mtnlg_jax.parallel.mesh import mesh_from_config  # noqa: E402

H100_PEAK_TFLOPS, ASSUMED_MFU, GPUS = 989, 0.4, 8


def export(folder):
    paths = []
    for name, factory in default_sources():
        paths.append(os.path.join(folder, f'{name}.jsonl'))
        with open(paths[-1], 'w') as f:
            for text in factory():
                f.write(json.dumps({'text': text}) + '\n')
    return paths


def bench_preprocessing(folder):
    raw = export(folder)
    model = os.path.join(folder, 'tokenizer.model')
    start = time.perf_counter()
    Tokenizer.train((json.loads(line)['text'] for p in raw for line in open(p)), model[:-6], 8192)
    print(f'tokenizer: bpe 8192 trained in {time.perf_counter() - start:.1f} s')
    rows = []
    for workers in (1, 2):  # both sources in one call: the worker processes start once
        writer, seconds = tokenize(raw, model, os.path.join(folder, 'both'), workers=workers)
        rows.append((workers, writer.documents, writer.tokens, seconds))
    for path in raw:  # the two sources the loader blends
        tokenize([path], model, path[: -len('.jsonl')])
    prefixes = [p[: -len('.jsonl')] for p in raw]
    return rows, prefixes


def step_consumes(name, config):
    """(samples/s a train step consumes, how it was obtained)."""
    if name == 'tiny':
        args = argparse.Namespace(path='configs/tiny.py', micro_steps=config.train.micro_steps)
        step_s = throughput.measure(args, 4, 1, 2, steps=3)['step_s']
        return config.train.global_batch / step_s, f'measured: {step_s:.2f} s/step on this CPU'
    params = counts.count_params(gpt.split(nnx.eval_shape(lambda: gpt.create(config.model, 0)))[1])
    flops_per_token = counts.model_flops_per_token(config.model, params)
    tokens_per_s = ASSUMED_MFU * H100_PEAK_TFLOPS * 1e12 * GPUS / flops_per_token
    return tokens_per_s / config.model.seq_len, f'estimate: {GPUS} x H100 at {ASSUMED_MFU:.0%} MFU'


def bench_loader(name, prefixes, batches):
    config = config_lib.load(f'configs/{name}.py')
    config.data.sources = tuple((0.5, p) for p in prefixes)
    config.model.vocab_size = 8192
    config.train.rampup.start = 0
    config.mesh.update(dict(data=4, stage=1, tensor=2) if name == 'tiny' else dict(data=8))
    config = config_lib.resolve(config, jax.device_count())
    train = loader_lib.open_datasets(config)['train']
    batch = config.train.global_batch
    train.samples(0, batch)  # the first epoch's index: built once per run, cached
    start = time.perf_counter()
    for i in range(1, batches + 1):
        train.samples(i * batch, batch)
    host = batches * batch / (time.perf_counter() - start)
    stream = loader_lib.TrainBatches(config, train, mesh_from_config(config), batch)
    next(stream)
    start = time.perf_counter()
    for _ in range(batches):
        jax.block_until_ready(next(stream).tokens)
    placed = batches * batch / (time.perf_counter() - start)
    stream.close()
    needed, how = step_consumes(name, config)
    return (name, config.model.seq_len, batch, host, placed, needed, how)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batches', type=int, default=20, help='batches timed per loader row')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        preprocessing, prefixes = bench_preprocessing(folder)
        loading = [bench_loader(name, prefixes, args.batches) for name in ('tiny', 'gpt2_124m')]
    load = os.getloadavg()[0]
    print(f'command: python {" ".join(sys.argv)}')
    print(f'machine: {os.cpu_count()} cores, load average {load:.1f}, jax {jax.__version__}')
    print_table(
        ['workers', 'documents', 'tokens', 'seconds', 'documents/s', 'tokens/s'],
        [
            [w, f'{d:,}', f'{t:,}', f'{s:.1f}', f'{d / s:,.0f}', f'{t / s:,.0f}']
            for w, d, t, s in preprocessing
        ],
    )
    print_table(
        [
            'config',
            'seq',
            'global batch',
            'host read samples/s',
            'placed on 8 devices samples/s',
            'a step consumes samples/s',
            'headroom',
            'step figure',
        ],  # fmt: skip
        [
            [
                name,
                seq,
                batch,
                f'{host:,.0f}',
                f'{placed:,.0f}',
                f'{needed:,.1f}',
                f'{placed / needed:,.1f} x',
                how,
            ]  # fmt: skip
            for name, seq, batch, host, placed, needed, how in loading
        ],
    )


def print_table(header, rows):
    print()
    for row in [header, ['---'] * len(header), *rows]:
        print('| ' + ' | '.join(str(cell) for cell in row) + ' |')


if __name__ == '__main__':
    main()
