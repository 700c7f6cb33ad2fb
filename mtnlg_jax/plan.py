"""Arithmetic of a run: parameters, FLOPs, bytes per device, device peaks.

FLOPs follow REFERENCE.md:
  model FLOPs per token (PaLM, for MFU; recompute not counted):  6 N + 12 L H Q T
  Megatron's hardware FLOPs per step with full recompute:
      96 B s l h^2 (1 + s / (6 h) + V / (16 l h))      (72 instead of 96 without recompute)
"""

import math

import jax
import numpy as np

# Dense peak TFLOP/s by device kind (substring of jax.Device.device_kind) and compute dtype.
# Unknown devices (and every CPU) have no peak: MFU is then reported as null.
DEVICE_PEAK_TFLOPS = {
    'H200': {'bfloat16': 989.0, 'float16': 989.0, 'float32': 67.0},
    'H100': {'bfloat16': 989.0, 'float16': 989.0, 'float32': 67.0},
    'A100': {'bfloat16': 312.0, 'float16': 312.0, 'float32': 19.5},
    'V100': {'float16': 125.0, 'float32': 15.7},
    'TPU v4': {'bfloat16': 275.0},
    'TPU v5p': {'bfloat16': 459.0},
    'TPU v5 lite': {'bfloat16': 197.0},
}


def device_peak_tflops(device, compute_dtype):
    """Peak dense TFLOP/s of one device for the compute dtype, or None if unknown."""
    for kind, peaks in DEVICE_PEAK_TFLOPS.items():
        if kind.lower() in device.device_kind.lower():
            return peaks.get(compute_dtype)
    return None


def count_params(params):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def model_flops_per_token(model_cfg, num_params):
    """PaLM's 6 N + 12 L H Q T: matmuls forward and backward plus attention scores."""
    head_dim = model_cfg.hidden // model_cfg.heads
    attention = 12 * model_cfg.num_layers * model_cfg.heads * head_dim * model_cfg.seq_len
    return 6 * num_params + attention


def megatron_flops_per_step(model_cfg, global_batch, recompute=True):
    """Megatron-LM 2021's per-iteration FLOPs (eq. 3), with or without full recompute."""
    b, s, h = global_batch, model_cfg.seq_len, model_cfg.hidden
    layers, v = model_cfg.num_layers, model_cfg.padded_vocab
    factor = 96 if recompute else 72
    return factor * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def _shard_bytes(abstract_tree, shardings, dtype=None):
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        itemsize = np.dtype(dtype or leaf.dtype).itemsize
        total += math.prod(sharding.shard_shape(leaf.shape)) * itemsize
    return total


def bytes_per_device(config, setup):
    """Bytes one device holds of each part of the training state (the largest shard).

    parameters:  the compute-dtype copy the forward runs on (rule table: split over tensor)
    gradients:   fp32 accumulators (split over tensor and, ZeRO, over data)
    optimizer:   fp32 master weights + Adam's two moments (split over tensor and data)
    """
    params = setup.abstract_state['params']
    zero = setup.state_shardings['params']
    return dict(
        parameters=_shard_bytes(params, setup.compute_shardings, config.model.compute_dtype),
        gradients=_shard_bytes(params, zero, 'float32'),
        optimizer=3 * _shard_bytes(params, zero, 'float32'),
    )


def format_bytes(n):
    for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
        if n < 1024 or unit == 'TiB':
            return f'{n:.1f} {unit}' if unit != 'B' else f'{n} B'
        n /= 1024
