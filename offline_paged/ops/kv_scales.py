"""KvScales: one layer's FP8 KV-cache scales, and the e4m3 quantize / dequantize the NumPy backend uses.

An FP8 KV cache stores K and V as float8_e4m3fn (ml_dtypes; 1 byte per element, largest finite value
448, 3 mantissa bits: relative rounding error up to 2^-4 = 6.25e-2). A stored element is
`clip(x / scale, -448, 448)` rounded to e4m3 (saturating, like the CUDA conversion vLLM uses, so no
NaN ever enters the cache); attention reads `stored * scale`. Each layer has its own K and V scale.

Scales: 1.0 by default (vLLM's default for a checkpoint without k_scale / v_scale). With
`calculate=True` the first write that has rows sets them from that batch, as vLLM's
`calculate_kv_scales` does: k_scale = max|k| / 200, v_scale = max|v| / 100 (vLLM's K_SCALE_CONSTANT and
V_SCALE_CONSTANT; dividing by less than 448 leaves room for later tokens larger than the first
prefill's), and never again. K is taken after RoPE: the rotated k is what the cache holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_E4M3_MAX = 448.0
# The FP8 pool's element type on the CUDA backend (CuPy has no float8): the e4m3fn bits as uint8.
FP8_STORAGE_CUDA = np.dtype(np.uint8)
# vLLM's divisors of the first batch's max |k| and max |v| (envs K_SCALE_CONSTANT, V_SCALE_CONSTANT).
K_SCALE_DIVISOR = 200.0
V_SCALE_DIVISOR = 100.0
# EngineConfig.kv_cache_dtype -> the pool's element type (None: the model's dtype).
KV_CACHE_NUMPY_DTYPES = {"auto": None, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3}


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) == FP8_E4M3


def quantize_fp8(x, scale: float):
    """x [...] (float) -> float8_e4m3fn [...] of clip(x / scale, +-448)."""
    scaled = x / np.asarray(scale, dtype=x.dtype) if scale != 1.0 else x
    return np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8_E4M3)


def dequantize(cached, scale: float, dtype):
    """Cache rows [...] (FP8 or not) -> `dtype` [...] times `scale` (a no-op multiply skipped at 1.0)."""
    values = cached.astype(dtype, copy=False)
    return values * np.asarray(scale, dtype=dtype) if scale != 1.0 else values


@dataclass(slots=True)
class KvScales:
    """One layer's K and V scales (stored = x / scale, read = stored * scale). Mutable on purpose: with
    `calculate`, the first `observe` that sees rows fixes both scales, and later ones change nothing."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    calculate: bool = False

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not np.isfinite(value):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")

    def observe(self, k, v) -> None:
        """k, v: [T, Hkv, D] rows about to be written (padding rows excluded by the caller)."""
        if not self.calculate or k.size == 0:
            return
        self.observe_amax(float(np.max(np.abs(k))), float(np.max(np.abs(v))))

    def observe_amax(self, k_amax: float, v_amax: float) -> None:
        """`observe` given max|k| and max|v| of the rows (the CUDA backend reduces them on the device)."""
        if not self.calculate:
            return
        self.k_scale = _scale_from(k_amax, K_SCALE_DIVISOR)
        self.v_scale = _scale_from(v_amax, V_SCALE_DIVISOR)
        self.calculate = False


def _scale_from(amax: float, divisor: float) -> float:
    """max|x| / divisor; 1.0 when x is all zeros (any scale stores zeros exactly) or not finite."""
    return amax / divisor if amax > 0 and np.isfinite(amax) else 1.0
