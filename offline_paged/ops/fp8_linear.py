"""Fp8Linear: a linear layer's weight in FP8 e4m3 with one scale per output channel, multiplied with
per-token dynamically quantized activations: vLLM's quantization="fp8" of a 16-bit checkpoint, on NumPy
(the reference a GPU FP8 GEMM must match).

Weight W [in, out]: weight_scale[j] = max_i |W[i, j]| / 448 (1.0 for an all-zero column), stored
e4m3(W[:, j] / weight_scale[j]) (rounded to nearest even, saturating: kv_scales.quantize_fp8).
Activations x [T, in]: per row t, x_scale[t] = max |x[t]| / 448 (1.0 for a zero row), xq = e4m3(x / x_scale).
Static activations (a pre-quantized checkpoint's `input_scale` s): x_scale[t] = s for every row, xq =
e4m3(clip(x / s, +-448)).
A pre-quantized checkpoint's linear (`from_quantized`) keeps its e4m3 values and scales as they are: a per-tensor
scale becomes that value on each of its output channels (a fused qkv keeps each part's own scale, exactly).
Product: y[t, j] = (bf16(sum_i xq[t, i] wq[i, j]) x_scale[t]) weight_scale[j], the sum accumulated in float32 or
wider and rounded once to bfloat16 (BF16_PRODUCTS; on a GPU the GEMM writes it so, and an epilogue applies the two
scales).

`x @ layer` works for a NumPy x (the model's `matmul` is operator.matmul on the CPU): `__array_ufunc__ =
None` makes NumPy defer to `Fp8Linear.__rmatmul__`. On the CPU the e4m3 values are also kept widened to
float32 for BLAS (memory is not what the reference saves).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from offline_paged.ops.kv_scales import FP8_E4M3, FP8_E4M3_MAX, quantize_fp8

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization values besides None
# Round each unscaled sum to bfloat16 before the scales multiply it. On a GPU the [T, out] sums go through memory
# between cuBLASLt's GEMM and the epilogue that applies per-token x per-channel scales (sm_90's cuBLASLt cannot), so
# bfloat16 moves half float32's bytes; it costs 2^-9 relative, against e4m3's 2^-4 on every weight and input. Not
# float16: the sums reach 448^2 x K. False: the float32 sums (the GPU's accumulator then float32 too).
BF16_PRODUCTS = True
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def fp8_scales(amax):
    """amax [...] -> float32 scales amax / 448, 1.0 where amax is 0 (zeros quantize exactly with any scale)."""
    amax = np.asarray(amax, dtype=np.float32)
    return np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)


def quantize_rows(x):
    """Per-token dynamic quantization: x [T, in] -> (xq [T, in] float8_e4m3fn, x_scale [T] float32)."""
    x_scale = fp8_scales(np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0]))  # [T]
    scaled = x / x_scale[:, None].astype(x.dtype)  # [T, in]
    return quantize_fp8(scaled, 1.0), x_scale


def quantize_static(x, input_scale: float):
    """Static per-tensor quantization: x [T, in] -> (xq [T, in] float8_e4m3fn, x_scale [T] all input_scale)."""
    return quantize_fp8(x, input_scale), np.full(x.shape[0], input_scale, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    """An e4m3 weight [in, out] and its per-output-channel float32 scales [out]; immutable."""

    weight: np.ndarray  # [in, out] float8_e4m3fn
    weight_scale: np.ndarray  # [out] float32
    _widened: np.ndarray = field(repr=False, compare=False)  # [in, out] float32: weight's values, for BLAS
    input_scale: float | None = None  # static per-tensor activation scale; None: dynamic, per token

    __array_ufunc__ = None  # NumPy defers `x @ layer` to __rmatmul__

    @classmethod
    def quantize(cls, w) -> "Fp8Linear":
        """w [in, out] (float) -> its FP8 form with one scale per output channel."""
        w = np.asarray(w)
        if w.ndim != 2:
            raise ValueError(f"an FP8 linear weight must be 2-D [in, out], got shape {w.shape}")
        weight_scale = fp8_scales(np.abs(w).max(axis=0))  # [out]
        weight = quantize_fp8(w / weight_scale[None, :].astype(w.dtype), 1.0)  # [in, out]
        return cls(weight, weight_scale, weight.astype(np.float32))

    @classmethod
    def from_quantized(cls, weights, weight_scales, input_scales=None) -> "Fp8Linear":
        """A pre-quantized linear from its checkpoint parts (a fused qkv or gate_up has several, in order):
        weights [out_i, in] float8_e4m3fn; weight_scales of one element (per tensor) or out_i (per output
        channel) each; input_scales: one per part (static activations: their max, as vLLM fuses them) or None."""
        columns, scales = [], []
        for w, s in zip(weights, weight_scales, strict=True):
            w, s = np.asarray(w), np.asarray(s, dtype=np.float32).reshape(-1)
            if w.ndim != 2 or w.dtype != FP8_E4M3:
                raise ValueError(f"a pre-quantized FP8 weight must be 2-D float8_e4m3fn, got {w.dtype} {w.shape}")
            if s.size not in (1, w.shape[0]) or not (np.isfinite(s) & (s >= 0)).all():
                raise ValueError(f"FP8 weight scales must be finite, >= 0, one per tensor or per output channel "
                                 f"({w.shape[0]}), got {s.size} values")
            columns.append(w)
            scales.append(np.broadcast_to(s, (w.shape[0],)))  # [out_i]
        # [in, out] e4m3, laid out as `quantize` lays it (a transposed [out, in]): BLAS then sums in the same order
        weight = np.concatenate(columns, axis=0).T
        input_scale = None if input_scales is None else max(float(x) for x in input_scales)
        return cls(weight, np.concatenate(scales).astype(np.float32), weight.astype(np.float32), input_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def dequantized(self, dtype=np.float32):
        """weight x weight_scale as `dtype` [in, out] (tests, and what the product computes with)."""
        return self._widened.astype(dtype) * self.weight_scale[None, :].astype(dtype)

    def __rmatmul__(self, x):
        """x [T, in] @ this layer -> [T, out] in x's dtype (see the module docstring)."""
        if x.ndim != 2 or x.shape[1] != self.weight.shape[0]:
            raise ValueError(f"cannot multiply x of shape {x.shape} by an FP8 weight of shape {self.weight.shape}")
        acc_dtype = np.promote_types(x.dtype, np.float32)
        xq, x_scale = quantize_rows(x) if self.input_scale is None else quantize_static(x, self.input_scale)
        acc = xq.astype(acc_dtype) @ self._widened.astype(acc_dtype, copy=False)  # [T, out]
        if BF16_PRODUCTS:
            acc = acc.astype(BFLOAT16).astype(acc_dtype)
        return (acc * x_scale[:, None].astype(acc_dtype) * self.weight_scale[None, :].astype(acc_dtype)).astype(
            x.dtype, copy=False)


__all__ = ["FP8_E4M3", "Fp8Linear", "QUANTIZATIONS", "fp8_scales", "quantize_rows", "quantize_static"]
