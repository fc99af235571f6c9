"""CudaFp8Linear: an FP8 (e4m3) linear layer on the GPU, the device form of ops/fp8_linear.py's Fp8Linear (the NumPy
reference it must match): quantization="fp8" and pre-quantized FP8 checkpoints on CUDA.

Storage: the weight kept as the checkpoint has it, [out, in] (K-major, the layout cuBLASLt's FP8 GEMM on Hopper
needs for its A operand), as uint8 e4m3 bits padded with zeros to [Np, Kp] (multiples of 16, its alignment rule);
one float32 scale per output channel [Np] (1.0 on padding rows).
Product x [T, K] (float16 / bfloat16) -> [T, N] of x's dtype, three launches on the current stream, none of which
allocates outside CuPy's pool or synchronises (so a decode graph captures them):
1. quantize_rows_fp8: xq [T, Kp] e4m3 and x_scale [T] (per token: max|x[t]| / 448; or the static input_scale);
2. TunedGemm.fp8: acc [T, Np] = xq @ wq^T (cuBLASLt; its tensor cores' fast accumulation, cublaslt.FP8_FAST_ACCUM,
   or sums promoted to float32; algorithm timed per shape), written as bfloat16 (fp8_linear.BF16_PRODUCTS: half the
   bytes of float32 through memory) or float32;
3. scale_fp8_output: out[t, j] = (acc[t, j] x_scale[t]) w_scale[j], rounded once to x's dtype.
cuBLASLt's per-tensor A/B scales cannot express per-token x per-channel ones, so they are step 3 (our epilogue); the
accumulator's type keeps fp16 from overflowing (unscaled sums reach 448^2 K). Where the library offers its
outer-vector scale modes for the shape (CUDA 12.9+; whether sm_90 has them was not known when this was written), steps
2-3 are one cuBLASLt call writing x's dtype directly (`SCALES_IN_CUBLASLT`; padded output widths always take 2-3).

`x @ layer` works for a cupy x (the model's eager `matmul` is operator.matmul): `__array_ufunc__ = None` makes CuPy
defer to `__rmatmul__`, which runs through the TunedGemm `gemm_source()` returns for the current stream (CudaOps
keeps one per stream). The decode graphs' TunedGemm calls `apply` itself (TunedGemm.__call__ sees the layer).
Legend: T rows, K in features, N out features, Kp / Np padded to multiples of 16.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import cupy
import numpy as np

from offline_paged.ops.fp8_launcher import quantize_rows_fp8, scale_fp8_output
from offline_paged.ops import fp8_linear
from offline_paged.ops.fp8_linear import Fp8Linear
from offline_paged.ops.kv_scales import FP8_STORAGE_CUDA
from offline_paged.ops.launchers import fp8_padded


# rms_norm and silu_mul quantize their output for the FP8 layer it feeds (CudaOps' `feeds`; Fp8Rows below), which
# saves three of a layer's four quantize launches, and read the o_proj, gate_up and down products before their scale
# epilogue (CudaOps.deferred; Fp8Product below), which saves three of its four epilogue launches. False: 16-bit
# arrays between the kernels, `apply` quantizing and scaling (the same bytes either way).
FUSED_FP8_INPUTS = True

# Let cuBLASLt apply the scales itself where it can (TunedGemm.fp8_scaled: outer-vector scale modes, a 16-bit D, and
# no accumulator through memory); False: always steps 2-3 above. Either way the same product, except that cuBLASLt's
# epilogue scales the float32 sums before their one rounding (no BF16_PRODUCTS step; sm_90 has no such algorithm).
SCALES_IN_CUBLASLT = True


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """An FP8 layer's input already quantized by the kernel that made it (CudaOps.rms_norm / silu_mul with
    `feeds`): what `apply` would have made of the 16-bit rows [T, K] of `dtype`. `shape` is theirs."""

    xq: Any  # [T, Kp] uint8 (e4m3fn bits; columns K..Kp-1 zero)
    scales: Any  # [T] float32
    width: int  # K
    dtype: Any  # the rows' 16-bit dtype, which the product returns

    __array_ufunc__ = None  # `rows @ layer` goes to CudaFp8Linear.__rmatmul__

    @property
    def shape(self) -> tuple[int, int]:
        return self.xq.shape[0], self.width


@dataclass(frozen=True, slots=True)
class Fp8Product:
    """An FP8 layer's product before its scale epilogue (a `deferred` layer's `apply`): the [T, N] output of `dtype`
    is (acc[t, j] x_scale[t]) x w_scale[j] rounded once, which CudaOps.rms_norm and silu_mul read in directly
    (`args` for launchers' `product=`); `materialize` writes it as scale_fp8_output does."""

    acc: Any  # [T, Np] bfloat16 (fp8_linear.BF16_PRODUCTS) or float32
    x_scale: Any  # [T] float32
    w_scale: Any  # [Np] float32
    width: int  # N
    dtype: Any  # the 16-bit dtype of the output

    __array_ufunc__ = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.acc.shape[0], self.width

    @property
    def args(self) -> tuple:
        return self.acc, self.x_scale, self.w_scale, self.width

    def materialize(self):
        """The [T, N] output of `dtype` (the scale epilogue's launch)."""
        return scale_fp8_output(self.acc, self.x_scale, self.w_scale, self.width, self.dtype)


@dataclass(frozen=True, slots=True)
class CudaFp8Linear:
    """e4m3 weight bits [Np, Kp] ([out, in], zero-padded) and per-output-channel float32 scales [Np] on the device.
    Immutable; `in_features` / `out_features` are the unpadded K and N."""

    weight: Any  # [Np, Kp] uint8 (e4m3fn bits)
    weight_scale: Any  # [Np] float32
    in_features: int
    out_features: int
    input_scale: float | None = None  # static per-tensor activation scale; None: dynamic, per token
    gemm_source: Callable[[], Any] | None = field(default=None, compare=False, repr=False)  # () -> TunedGemm
    # `apply` returns an Fp8Product (the scale epilogue left to the output's consumer) instead of an array wherever
    # our epilogue kernel would run; CudaOps.deferred makes this form for consumers that read products.
    deferred: bool = False

    __array_ufunc__ = None  # CuPy and NumPy defer `x @ layer` to __rmatmul__

    @classmethod
    def quantize(cls, w, gemm_source=None) -> "CudaFp8Linear":
        """w [out, in] float16 / bfloat16 on the device -> e4m3 with one scale per output channel (the per-row
        kernel of the activations: a weight's output channel is a row of [out, in]); Fp8Linear.quantize's rule."""
        if not isinstance(w, cupy.ndarray) or w.ndim != 2:
            raise ValueError(f"an FP8 linear weight must be a 2-D cupy array [out, in], got "
                             f"{type(w).__name__} {getattr(w, 'shape', '')}")
        num_out, num_in = w.shape
        weight = cupy.zeros((fp8_padded(num_out), fp8_padded(num_in)), dtype=FP8_STORAGE_CUDA)  # [Np, Kp]
        weight_scale = cupy.ones(fp8_padded(num_out), dtype=cupy.float32)  # [Np]
        quantize_rows_fp8(cupy.ascontiguousarray(w), weight.shape[1], xq=weight[:num_out],
                          scales=weight_scale[:num_out])
        return cls(weight, weight_scale, num_in, num_out, None, gemm_source)

    @classmethod
    def upload(cls, layer: Fp8Linear, gemm_source=None) -> "CudaFp8Linear":
        """A host Fp8Linear (a pre-quantized checkpoint's e4m3 values and scales) on the device, values unchanged."""
        num_in, num_out = layer.weight.shape
        if layer.input_scale is not None and not (np.isfinite(layer.input_scale) and layer.input_scale > 0):
            raise ValueError(f"an FP8 layer's static input_scale must be a positive finite number, got "
                             f"{layer.input_scale!r}")
        bits = np.zeros((fp8_padded(num_out), fp8_padded(num_in)), dtype=np.uint8)  # [Np, Kp]
        bits[:num_out, :num_in] = np.asarray(layer.weight).T.view(np.uint8)
        scales = np.ones(fp8_padded(num_out), dtype=np.float32)  # [Np]
        scales[:num_out] = layer.weight_scale
        return cls(cupy.asarray(bits), cupy.asarray(scales), num_in, num_out, layer.input_scale, gemm_source)

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out), as a 16-bit weight [in, out] has."""
        return self.in_features, self.out_features

    def dequantized(self):
        """weight x weight_scale as float32 [in, out] on the device (tests)."""
        from offline_paged.ops.kv_scales import FP8_E4M3

        values = cupy.asarray(cupy.asnumpy(self.weight).view(FP8_E4M3).astype(np.float32))  # [Np, Kp]
        return (values * self.weight_scale[:, None])[:self.out_features, :self.in_features].T

    def apply(self, x, gemm):
        """x [T, K] float16 / bfloat16 (or Fp8Rows made for this layer) -> [T, N] of x's dtype through `gemm` (a
        TunedGemm on the current stream)."""
        if isinstance(x, Fp8Rows):
            if x.width != self.in_features or x.xq.shape[1] != self.weight.shape[1]:
                raise ValueError(f"quantized rows of width {x.width} (padded {x.xq.shape[1]}) do not fit an FP8 "
                                 f"weight of shape {self.shape} (padded {self.weight.shape[1]})")
            xq, x_scale = x.xq, x.scales  # [T, Kp], [T]
        elif not isinstance(x, cupy.ndarray) or x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"cannot multiply x of shape {getattr(x, 'shape', type(x).__name__)} by an FP8 weight "
                             f"of shape {self.shape}")
        else:
            xq, x_scale = quantize_rows_fp8(cupy.ascontiguousarray(x), self.weight.shape[1], self.input_scale)
        if SCALES_IN_CUBLASLT and self.weight.shape[0] == self.out_features:
            out = cupy.empty((x.shape[0], self.out_features), dtype=x.dtype)  # [T, N]
            if gemm.fp8_scaled(xq, self.weight, x_scale, self.weight_scale, out):
                return out
        acc_dtype = fp8_linear.BFLOAT16 if fp8_linear.BF16_PRODUCTS else np.float32
        acc = cupy.empty((x.shape[0], self.weight.shape[0]), dtype=acc_dtype)  # [T, Np]
        gemm.fp8(xq, self.weight, acc)
        product = Fp8Product(acc, x_scale, self.weight_scale, self.out_features, x.dtype)
        return product if self.deferred else product.materialize()  # [T, N]

    def __rmatmul__(self, x):
        """x [T, K] @ this layer (the eager path): see the module docstring."""
        if self.gemm_source is None:
            raise RuntimeError("this CudaFp8Linear has no GEMM for `x @ layer`: build it through CudaOps")
        return self.apply(x, self.gemm_source())
