"""Rotary position embeddings (RoPE, arXiv 2104.09864) and Llama 3.1's frequency scaling.

`model.position = 'rope'` rotates each query and key head by its token's position instead of
adding a learned position table to the embedding. Pairs of channels are rotated as Hugging
Face's Llama does it ("rotate half": channel i pairs with channel i + head_dim / 2), so a
Hugging Face checkpoint's q/k kernels load without permuting their rows:

    inv_freq[i] = theta ** (-2 i / head_dim)                    i = 0 .. head_dim / 2 - 1
    angle       = position x inv_freq                           (..., seq, head_dim / 2)
    rope(x)     = x * cos(angle, angle) + rotate_half(x) * sin(angle, angle)
    rotate_half([x1, x2]) = [-x2, x1]

`model.rope_scaling.type = 'llama3'` (Llama 3.1, Hugging Face's `rope_type: llama3`) divides
the low frequencies by `factor`, keeps the high ones, and blends in between, with
wavelength = 2 pi / inv_freq and the original context L:

    wavelength > L / low_freq_factor     inv_freq / factor           (long waves: scaled)
    wavelength < L / high_freq_factor    inv_freq                    (short waves: kept)
    otherwise                            (1 - t) inv_freq / factor + t inv_freq,
                                         t = (L / wavelength - low) / (high - low)

Angles are computed in fp32 whatever the compute dtype, and the rotation too.
"""

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim, theta, scaling=None):
    """(head_dim / 2,) float64 numpy: each channel pair's angle per position. scaling: the
    `model.rope_scaling` dict (type 'none' or 'llama3' with factor, low_freq_factor,
    high_freq_factor, original_context)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None or scaling['type'] == 'none':
        return inv_freq
    factor, low, high = scaling['factor'], scaling['low_freq_factor'], scaling['high_freq_factor']
    context = scaling['original_context']
    wavelength = 2 * math.pi / inv_freq
    blend = (context / wavelength - low) / (high - low)
    middle = (1 - blend) * inv_freq / factor + blend * inv_freq
    return np.where(
        wavelength > context / low,
        inv_freq / factor,
        np.where(wavelength < context / high, inv_freq, middle),
    )


def rotate(x, positions, inv_freq):
    """x (batch, seq, heads, head_dim) rotated by positions (seq,) or (batch, seq) integers;
    returns x's dtype."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angle = jnp.concatenate([angle, angle], axis=-1)  # (..., seq, head_dim)
    if angle.ndim == 2:
        angle = angle[None]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
