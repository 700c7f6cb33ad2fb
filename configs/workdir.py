"""The config a workdir was made with (its config.json), to continue it with launch/train.py.

For a workdir that launch/convert.py imported from Hugging Face, or any earlier run:

    python launch/train.py --config configs/workdir.py:runs/gpt2 --workdir runs/gpt2 \
        --config.data.sources='((1.0, PREFIX),)' --config.train.steps=N [--config.mesh.tensor=2 ...]

Keys come back resolved; launch/train.py resolves them again for this run's devices (derived
keys are recomputed), and any key can still be overridden on the command line.
"""

import json
import os

import ml_collections


def get_config(workdir):
    path = os.path.join(workdir, 'config.json')
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))
