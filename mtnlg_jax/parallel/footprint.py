"""Bytes one device holds of a sharded training state, read from the shardings themselves."""

import math

import jax
import numpy as np


def _shard_bytes(abstract_tree, shardings, dtype=None):
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        itemsize = np.dtype(dtype or leaf.dtype).itemsize
        total += math.prod(sharding.shard_shape(leaf.shape)) * itemsize
    return total


def bytes_per_device(config, setup):
    """Bytes one device holds of each part of the training state (the largest shard).

    parameters:  the compute-dtype copy the forward runs on (rule table: split over tensor)
    gradients:   fp32 accumulators, as the compute copy: each replica sums its own until the
                 step's one reduce-scatter over data (train/step.py)
    optimizer:   fp32 master weights + Adam's two moments (split over tensor and data)
    """
    params = setup.abstract_state['params']
    zero = setup.state_shardings['params']
    return dict(
        parameters=_shard_bytes(params, setup.compute_shardings, config.model.compute_dtype),
        gradients=_shard_bytes(params, setup.compute_shardings, 'float32'),
        optimizer=3 * _shard_bytes(params, zero, 'float32'),
    )


def format_bytes(n):
    for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
        if n < 1024 or unit == 'TiB':
            return f'{n:.1f} {unit}' if unit != 'B' else f'{n} B'
        n /= 1024
