"""cuda/fp8.cuh's e4m3 conversions, compiled for the host by nvcc, equal ml_dtypes' (the NumPy FP8 path's) on
every fp16 and bf16 value, random floats over 10 decades, every rounding tie and the saturation edges
(CPU-only: needs nvcc, no GPU). The device kernels quantize through the same float_to_e4m3."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
PROGRAM = r"""
#include <cstdio>
#include <cmath>
#include "fp8.cuh"
// argv[1]: float32 inputs; argv[2]: one e4m3 byte per input, then the 256 scaled fp16 bit patterns.
int main(int argc, char** argv) {
  FILE* in = fopen(argv[1], "rb");
  FILE* out = fopen(argv[2], "wb");
  float x;
  while (fread(&x, 4, 1, in) == 1) {
    const unsigned char b = (unsigned char)float_to_e4m3(x);
    fwrite(&b, 1, 1, out);
  }
  for (unsigned b = 0; b < 256; ++b) {
    const unsigned short h = (unsigned short)e4m3_to_half_bits_scaled(b);
    fwrite(&h, 2, 1, out);
  }
  fclose(in);
  fclose(out);
  return 0;
}
"""

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    """(inputs [n] float32, their float_to_e4m3 bytes [n], e4m3_to_half_bits_scaled of bytes 0..255 [256])."""
    folder = tmp_path_factory.mktemp("fp8")
    (folder / "t.cu").write_text(PROGRAM)
    subprocess.run(["nvcc", "--std=c++17", f"-I{CUDA_DIR}", str(folder / "t.cu"), "-o", str(folder / "t")],
                   check=True, capture_output=True, timeout=300)
    x = _inputs()
    x.tofile(folder / "in.bin")
    subprocess.run([str(folder / "t"), str(folder / "in.bin"), str(folder / "out.bin")], check=True, timeout=60)
    raw = np.fromfile(folder / "out.bin", dtype=np.uint8)
    return x, raw[:x.size], raw[x.size:].view(np.uint16)


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    every_fp16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    every_bf16 = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    decades = rng.integers(-7, 4, 100_000).astype(np.float32)
    spread = rng.standard_normal(100_000).astype(np.float32) * np.float32(10.0) ** decades
    finite = np.sort(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64))
    finite = np.unique(finite[np.isfinite(finite)])
    ties = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exactly halfway: ties go to even
    edges = np.float32([448, 447.99997, 464, 464.0001, 480, 1e30, np.inf, -np.inf, 0.0, -0.0, 2 ** -6, 2 ** -10,
                        2 ** -9 * 0.5, 2 ** -9 * 1.5, np.nan])
    return np.concatenate([every_fp16, every_bf16, spread, ties, -ties, edges])


def test_quantize_equals_the_numpy_path_byte_for_byte(conversions):
    x, got, _ = conversions
    finite_or_inf = ~np.isnan(x)
    expected = np.clip(x, -448, 448).astype(E4M3).view(np.uint8)  # kv_scales.quantize_fp8's rule
    wrong = finite_or_inf & (got != expected)
    assert not wrong.any(), f"{wrong.sum()} inputs differ, e.g. {x[wrong][:5]}: {got[wrong][:5]} != {expected[wrong][:5]}"


def test_nan_stays_nan(conversions):
    x, got, _ = conversions
    assert np.all(got[np.isnan(x)] & 0x7F == 0x7F)


def test_the_fp16_bit_trick_dequantizes_every_finite_byte_exactly(conversions):
    _, _, half_bits = conversions
    values = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    dequantized = half_bits.view(np.float16).astype(np.float32) * 256  # the kernels' mul.f16x2 by 2^8
    finite = np.isfinite(values)
    np.testing.assert_array_equal(dequantized[finite], values[finite])
