"""RoPE tables: inverse frequencies (with llama3 / linear scaling) and the cos/sin cache.

The cache is [max_positions, head_dim] = concat(cos, sin), each over head_dim / 2 frequencies,
the layout `ops.rope` reads (neox / HF rotate-half pairing: dimension j pairs with j + head_dim/2).
"""
from __future__ import annotations

import math

import numpy as np

from .config import LlamaConfig, RopeScaling


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """Per-pair rotation speeds in float64, scaled as the config says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [D/2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)  # [D/2]
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)  # [D/2]
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled  # [D/2]
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def cos_sin_cache(config: LlamaConfig, dtype, max_positions: int | None = None) -> np.ndarray:
    """[max_positions, head_dim] host array concat(cos, sin) in `dtype`.

    For float32 and narrower the angle is formed as HF does (float32 frequency times float32
    position, rounded once), then cos/sin are taken in float64 and rounded: within an ulp of HF.
    """
    max_positions = max_positions or config.max_position_embeddings
    inv_freq = inverse_frequencies(config)  # [D/2]
    positions = np.arange(max_positions, dtype=np.float64)  # [P]
    if np.dtype(dtype).itemsize >= 8:
        angles = np.outer(positions, inv_freq)  # [P, D/2]
    else:
        angles = np.outer(positions.astype(np.float32), inv_freq.astype(np.float32)).astype(np.float64)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(dtype)  # [P, D]
