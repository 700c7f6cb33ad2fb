"""What naming stragglers costs, and whether a healthy run names one: launch/train.py under
launch/spawn.py (2 processes x 4 CPU devices, the tests' small model), the processes compared
every `--every` steps.

    python bench/stragglers.py [--steps 200] [--every 5] [--data PREFIX]

Prints the step time, what one comparison (probe and all-gather) costs on process 0, that cost
as a share of the steps between two comparisons at `--every` and at the default
train.straggler_every, and every `straggler` line the run printed (a healthy run: none).
Data: an indexed dataset prefix (default: a small pattern written to a temporary folder).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'tests'))

from mtnlg_jax.config import keys  # noqa: E402
from support import SMALL_MODEL  # noqa: E402  (the tests' small model)


def pattern_data(folder):
    from mtnlg_jax.data.indexed import IndexedDatasetWriter

    prefix = os.path.join(folder, 'pattern')
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(220):
        writer.add(np.random.default_rng(0).integers(0, 300, 97))
    writer.finish()
    return prefix


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--steps', type=int, default=200)
    parser.add_argument('--every', type=int, default=5)
    parser.add_argument('--data', default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        data = args.data or pattern_data(folder)
        workdir = os.path.join(folder, 'run')
        command = [
            sys.executable, os.path.join(ROOT, 'launch/spawn.py'), '--processes', '2',
            '--devices_per_process', '4', '--', os.path.join(ROOT, 'launch/train.py'),
            '--config', os.path.join(ROOT, 'configs/tiny.py'), '--workdir', workdir,
            *SMALL_MODEL, f'--config.train.steps={args.steps}', '--config.train.log_every=5',
            '--config.train.eval_every=0', '--config.checkpoint.every=100000',
            f'--config.train.straggler_every={args.every}',
            f"--config.data.sources=((1.0, {data!r}),)",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        if run.returncode != 0:
            sys.exit(f'the run failed:\n{run.stderr[-3000:]}')
        with open(os.path.join(workdir, 'metrics.jsonl')) as f:
            records = [json.loads(line) for line in f if line.strip()]
    lines = [line for line in re.split(r'[\r\n]+', run.stdout) if line.startswith('straggler')]
    step_s = statistics.median(r['step_time_s'] for r in records if not r.get('eval'))
    check_s = statistics.median(r['straggler_check_s'] for r in records if 'straggler_check_s' in r)
    default = keys.BY_NAME['train.straggler_every'].default
    print(f'steps {args.steps}, compared every {args.every}: step {step_s * 1e3:.1f} ms (median)')
    print(f'one comparison {check_s * 1e3:.2f} ms (median, process 0)')
    for every in (args.every, default):
        print(f'  every {every} steps: {check_s / (every * step_s):.3%} of the step time')
    print(f'straggler lines: {len(lines)}')
    for line in lines:
        print(f'  {line}')


if __name__ == '__main__':
    main(sys.argv[1:])
