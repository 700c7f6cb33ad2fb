"""Generation speed with and without the KV cache, for batch 1 and 8.

    python bench/generate.py [--configs configs/tiny.py configs/gpt2_124m.py] [--prompt 16]
                             [--new 32] [--output bench_generate.json]

Each row generates --new tokens greedily after a --prompt-token prompt for every sequence of
the batch, from randomly initialised parameters (speed does not depend on the values), fp32
compute, on a mesh of data 1 x the config's tensor size. Columns: tokens/s = batch x new
tokens / wall time of one call after a warm-up call (so compile time is excluded), and the
speed-up of the cache. Without the cache every step recomputes the whole sequence (prompt +
new tokens), so its cost grows with the length while the cached step's does not.
"""

import argparse
import json
import os
import sys
import time

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtnlg_jax import config as config_lib  # noqa: E402
from mtnlg_jax.eval.generation import Generator  # noqa: E402
from mtnlg_jax.model import gpt  # noqa: E402
from mtnlg_jax.parallel.mesh import mesh_from_config  # noqa: E402
from mtnlg_jax.train.state import make_setup  # noqa: E402


def make_generator(path):
    config = config_lib.load(path)
    tensor = max(config.mesh.tensor, 1)
    config.mesh.update(dict(data=1, stage=1, tensor=tensor))
    config.train.update(dict(global_batch=1, micro_batch=1))
    config.model.compute_dtype = 'float32'  # bf16 matmuls are slow on CPU
    config = config_lib.resolve(config, tensor)
    mesh = mesh_from_config(config)
    setup = make_setup(config, mesh)
    with jax.set_mesh(mesh):
        params = jax.jit(
            lambda: gpt.split(gpt.create(config.model, 0))[1],
            out_shardings=setup.compute_shardings,
        )()
    return Generator(setup.graphdef, params, config.model, mesh), config


def tokens_per_second(generate, prompts, new_tokens, use_cache):
    generate(prompts, new_tokens, use_cache=use_cache)  # compile
    start = time.perf_counter()
    outputs = generate(prompts, new_tokens, use_cache=use_cache)
    seconds = time.perf_counter() - start
    assert all(len(row) == new_tokens for row in outputs)
    return len(prompts) * new_tokens / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--configs', nargs='+', default=['configs/tiny.py', 'configs/gpt2_124m.py'])
    parser.add_argument('--prompt', type=int, default=16, help='prompt tokens')
    parser.add_argument('--new', type=int, default=32, help='new tokens per sequence')
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 8])
    parser.add_argument('--output', help='also write the rows as JSON')
    args = parser.parse_args()

    device = jax.devices()[0]
    print(f'command: python {" ".join(sys.argv)}')
    print(f'machine: {device.platform}, {os.cpu_count()} cores, jax {jax.__version__}\n')
    columns = (
        'config',
        'tensor',
        'batch',
        'prompt + new',
        'no cache tokens/s',
        'KV cache tokens/s',
    )
    print('| ' + ' | '.join(columns + ('speed-up',)) + ' |')
    print('|---|---|---|---|---|---|---|')
    rows = []
    for path in args.configs:
        generate, config = make_generator(path)
        rng = np.random.default_rng(0)
        for batch in args.batches:
            prompts = rng.integers(0, config.model.vocab_size, (batch, args.prompt)).tolist()
            full = tokens_per_second(generate, prompts, args.new, use_cache=False)
            cached = tokens_per_second(generate, prompts, args.new, use_cache=True)
            row = dict(
                config=os.path.basename(path),
                tensor=config.mesh.tensor,
                batch=batch,
                prompt=args.prompt,
                new=args.new,
                no_cache_tokens_per_s=full,
                cache_tokens_per_s=cached,
            )
            rows.append(row)
            print(
                f'| {row["config"]} | {row["tensor"]} | {batch} | {args.prompt} + {args.new} | '
                f'{full:,.1f} | {cached:,.1f} | {cached / full:.1f}x |',
                flush=True,
            )
    if args.output:
        with open(args.output, 'w') as f:
            json.dump(rows, f, indent=2)


if __name__ == '__main__':
    main()
