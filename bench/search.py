"""The step-time model against published step times, and the 530 B layout search.

    python bench/search.py [--nodes 280]

Prints (1) every published row of plan/published.py: its source, layout, published step time,
the prediction (plan/predict.py, fitted on Narayanan et al. 2021 table 1 only) and the error,
with the worst error of the fitted and of the held-back rows; (2) the ten fastest layouts of
configs/mtnlg_530b.py on `--nodes` DGX A100 nodes that fit, and the paper's layout (tensor 8 x
pipeline 35, 1F1B, micro-batch 1, full recompute, no sequence parallelism) predicted the same
way, as `launch/plan.py --search` prints them. No compile: minutes at most.
"""

import argparse
import pathlib
import sys
import time

import ml_collections

from mtnlg_jax.run import cli
from mtnlg_jax.plan import clusters, predict, published, search

ROOT = pathlib.Path(__file__).resolve().parents[1]
A100 = clusters.CLUSTERS['a100-80gb']


def published_table():
    out = [
        '| source | layout | published | predicted | error |',
        '|---|---|---|---|---|',
    ]
    worst = {True: 0.0, False: 0.0}
    for row, seconds, step in predict.predict_rows(published.ROWS, A100):
        error = step['predicted_step_s'] / seconds - 1
        worst[row.fit] = max(worst[row.fit], abs(error), key=abs)
        figure = f'{row.seconds} s' if row.seconds else f'{row.tflops} TFLOP/s = {seconds:.2f} s'
        source = row.source.split(' (')[0] + ', ' + row.source.rsplit('), ')[-1]
        out.append(
            f'| {source}{" (fit)" if row.fit else ""} | {row.name} | {figure} | '
            f'{step["predicted_step_s"]:.2f} s | {100 * error:+.1f} % |'
        )
    out.append(
        f'worst error: {100 * worst[True]:.1f} % on the fitted rows, {100 * worst[False]:.1f} % '
        f'on the held-back rows'
    )
    return out


def paper_layout(devices):
    """configs/mtnlg_530b.py as the paper ran it: full recompute, no sequence parallelism,
    1F1B with no bound on the micro-batches in flight."""
    config = cli.load_config(str(ROOT / 'configs/mtnlg_530b.py'))
    config.model.sequence_parallel = False
    config.model.remat = 'full'
    config.pipeline.update(dict(repeats=1, max_in_flight=0))
    return ml_collections.ConfigDict(config.to_dict())


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--nodes', type=int, default=280)
    args = parser.parse_args(argv)
    print(f'$ python bench/search.py {" ".join(argv)}'.rstrip())
    print('\n'.join(published_table()))
    devices = args.nodes * A100.gpus_per_node
    inputs = paper_layout(devices)
    start = time.time()
    result = search.search(inputs, devices, A100)
    print(
        f'\nthe search of launch/plan.py --config configs/mtnlg_530b.py --search --cluster '
        f'a100-80gb --nodes {args.nodes} (every layout key free); "as": the paper\'s layout '
        f'(full recompute, no sequence parallelism); {time.time() - start:.0f} s'
    )
    print('\n'.join(search.lines(result)))


if __name__ == '__main__':
    main(sys.argv[1:])
