"""What the benchmarks that drive launch/plan.py share: one plan per subprocess (each needs its own
device count and compiler set up before JAX starts), and the markdown tables they print."""

import argparse
import json
import pathlib
import subprocess
import sys

from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def argument_parser(doc, results):
    """The command line these benchmarks share: --results (the folder of the JSON plans,
    default `results`) and --reuse."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        '--results',
        type=pathlib.Path,
        default=pathlib.Path(results),
        help='folder of the JSON plans',
    )
    parser.add_argument('--reuse', action='store_true', help='keep JSON plans already there')
    return parser


def run_plans(jobs, reuse, desc, keep_going=False):
    """Run each (name, command, JSON path) whose JSON is missing (or every one unless `reuse`),
    with a progress bar; the first failure ends the benchmark with its stderr, or, keep_going,
    the others run and it returns {name: the failure's cause in one line} (else {})."""
    failed = {}
    for name, command, path in tqdm(jobs, desc=desc, unit='compile'):
        if reuse and path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tqdm.write(' '.join(str(part) for part in command[1:]))
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 and not keep_going:
            sys.exit(f'{name}: launch/plan.py failed:\n{done.stderr[-3000:]}')
        if done.returncode != 0:
            failed[name] = cause(done.stderr)
            tqdm.write(f'{name}: failed: {failed[name]}')
    return failed


def cause(stderr):
    """A failed plan's cause in one line: its last `error:` line (launch/plan.py's), else its
    last line of output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith('error:')]
    return (errors or lines or ['no output'])[-1][:300]


def failed_row(header, lead, why):
    """A table row of a compile that failed: its name (and target), the cause, '-' elsewhere."""
    cells = [*lead, f'failed: {why}'.replace('|', '/')]
    return cells + ['-'] * (len(header) - len(cells))


def read_plan(path):
    return json.loads(pathlib.Path(path).read_text())


def print_markdown(header, rows):
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '|'.join('---' for _ in header) + '|')
    for row in rows:
        print('| ' + ' | '.join(str(cell) for cell in row) + ' |')
