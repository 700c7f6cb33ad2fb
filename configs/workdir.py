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


def _tuples(value):
    """JSON has only lists; the config's sequences are tuples (and only tuples can be
    overridden on the command line)."""
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value


def get_config(workdir):
    path = os.path.join(workdir, 'config.json')
    with open(path) as f:
        return ml_collections.ConfigDict(_tuples(json.load(f)))
