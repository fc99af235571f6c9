// FP8 (e4m3fn) KV-cache elements: the conversions every kernel that writes or reads an FP8 cache shares
// (cache.cu, layer.cu, attention.cu, prefill_attention.cu include it; kernel_modules.py inlines it for
// NVRTC). No buffers, no kernels. Self-contained: no cuda_fp16.h, no bf16 type (the files differ there).
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; largest finite 448 (S.1111.110), the only NaN
// S.1111.111, no infinity; subnormals m * 2^-9. On the CUDA backend the pool is uint8 (the bits).
// Write: stored = e4m3(x / scale), rounded to nearest even and saturated to +-448, exactly what the
// NumPy reference (offline_paged/ops/kv_scales.py: clip then ml_dtypes' cast) stores. Read: stored * scale,
// where the kernels fold k_scale into the softmax scale and v_scale into the output.
#ifndef OFFLINE_PAGED_FP8_CUH
#define OFFLINE_PAGED_FP8_CUH

// One e4m3fn element (its bits). A distinct type, so kernels template on the cache element type.
struct fp8_e4m3_t {
  unsigned char bits;
};

template <typename C>
constexpr bool kIsFp8 = false;
template <>
constexpr bool kIsFp8<fp8_e4m3_t> = true;

// float -> e4m3fn bits: round to nearest even, |x| >= 448 (and infinities) saturate to +-448, NaN stays NaN.
// Host and device (tests/test_fp8_conversions.py runs it on the host against ml_dtypes).
__host__ __device__ __forceinline__ unsigned float_to_e4m3(float x) {
  union {
    float f;
    unsigned u;
  } in;
  in.f = x;
  const unsigned sign = (in.u >> 24) & 0x80u;
  const unsigned mag = in.u & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (mag >= 0x43e00000u) return sign | 0x7eu;  // |x| >= 448: the largest finite
  if (mag < 0x3c800000u) {                       // |x| < 2^-6: subnormal, a multiple of 2^-9
    in.u = mag;
    return sign | (unsigned)rintf(in.f * 512.f);  // exact product; rintf ties to even; 8 encodes 2^-6
  }
  // Normal: keep 3 of the 23 mantissa bits, ties to even (a carry rounds into the exponent), and
  // rebias the exponent from 127 to 7.
  const unsigned rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
  return sign | (((rounded >> 20) - (120u << 3)) & 0x7fu);
}

// The bits of the fp16 number (e4m3 value) * 2^-8, for one e4m3 byte b: the sign moves to bit 15 and
// exponent+mantissa to bits 7..13 (fp16's exponent bias is 8 more than e4m3's). Exact, subnormals too.
__host__ __device__ __forceinline__ unsigned e4m3_to_half_bits_scaled(unsigned b) {
  return ((b & 0x80u) << 8) | ((b & 0x7fu) << 7);
}

// Two e4m3 bytes as an fp16 pair times 2^-8, from a word whose 16-bit lanes hold byte << 8 (lo lane: first).
__device__ __forceinline__ unsigned e4m3x2_spread_to_half2_scaled(unsigned spread) {
  return (spread & 0x80008000u) | ((spread & 0x7f007f00u) >> 1);
}

// Four e4m3 bytes of `w` (byte 0 first) -> two words of fp16 pairs (bytes 0, 1) and (bytes 2, 3), exact.
__device__ __forceinline__ void e4m3x4_to_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
  const unsigned two_pow_8 = 0x5c005c00u;  // (256, 256) in fp16
  const unsigned a = e4m3x2_spread_to_half2_scaled(__byte_perm(w, 0u, 0x1404));  // (b0 << 8, b1 << 8)
  const unsigned b = e4m3x2_spread_to_half2_scaled(__byte_perm(w, 0u, 0x3424));  // (b2 << 8, b3 << 8)
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(a), "r"(two_pow_8));
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(b), "r"(two_pow_8));
}

// Two e4m3 bytes as a bf16 pair times 2^-120 (bf16's exponent bias is 120 more than e4m3's), from a word
// whose 16-bit lanes hold byte << 8 (lo lane: first): the sign stays at bit 15, exponent+mantissa go to bits
// 4..10. Exact, subnormals too.
__device__ __forceinline__ unsigned e4m3x2_spread_to_bf16x2_scaled(unsigned spread) {
  return (spread & 0x80008000u) | ((spread & 0x7f007f00u) >> 4);
}

// Four e4m3 bytes of `w` (byte 0 first) -> two words of bf16 pairs (bytes 0, 1) and (bytes 2, 3), exact: as
// e4m3x4_to_half2x2, without going through fp16 and float. fma with -0 (not mul.bf16x2, which needs sm_90):
// x * 2^120 + (-0) is x * 2^120 for every x, zeros keeping their sign.
__device__ __forceinline__ void e4m3x4_to_bf16x2x2(unsigned w, unsigned& lo, unsigned& hi) {
  const unsigned two_pow_120 = 0x7b807b80u;  // (2^120, 2^120) in bf16
  const unsigned minus_zero = 0x80008000u;
  const unsigned a = e4m3x2_spread_to_bf16x2_scaled(__byte_perm(w, 0u, 0x1404));  // (b0 << 8, b1 << 8)
  const unsigned b = e4m3x2_spread_to_bf16x2_scaled(__byte_perm(w, 0u, 0x3424));  // (b2 << 8, b3 << 8)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(lo) : "r"(a), "r"(two_pow_120), "r"(minus_zero));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(hi) : "r"(b), "r"(two_pow_120), "r"(minus_zero));
}

// Four e4m3 bytes of `w` (byte 0 first) -> two words of fp16 pairs by the hardware's conversion (sm_89+: one
// cvt.rn.f16x2.e4m3x2 per pair, the lower byte to the lower half), exact. The two NaN bytes read as NaN here
// (the bit path reads them as +-480); the pool never holds them, since writes saturate at +-448.
__device__ __forceinline__ void e4m3x4_to_half2x2_cvt(unsigned w, unsigned& lo, unsigned& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// Eight e4m3 bytes (w.x: elements 0..3, w.y: 4..7) -> eight fp16 in a 16-byte vector, element i in half i:
// 4 conversion instructions on sm_89+ against 24 on the bit path (the FP8 decode kernels are bound by their
// instructions, not their bytes: benchmarks/NOTES.md).
__device__ __forceinline__ uint4 e4m3x8_to_half8(uint2 w) {
  uint4 r;
#if __CUDA_ARCH__ >= 890
  e4m3x4_to_half2x2_cvt(w.x, r.x, r.y);
  e4m3x4_to_half2x2_cvt(w.y, r.z, r.w);
#else
  e4m3x4_to_half2x2(w.x, r.x, r.y);
  e4m3x4_to_half2x2(w.y, r.z, r.w);
#endif
  return r;
}

// Eight e4m3 bytes -> eight bf16 in a 16-byte vector, element i in half i.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(uint2 w) {
  uint4 r;
  e4m3x4_to_bf16x2x2(w.x, r.x, r.y);
  e4m3x4_to_bf16x2x2(w.y, r.z, r.w);
  return r;
}

// The vector writes below round on the hardware (1) or through float_to_e4m3 (0). The same bytes either way: the
// FP8 KV-write and linear GPU tests compare both the vector and the scalar paths with NumPy's.
#define FP8_HARDWARE_ROUNDING 1

// Two floats -> two e4m3 bytes (lo in bits 0-7, hi in 8-15). On sm_89+ one cvt.rn.satfinite.e4m3x2.f32: round to
// nearest even, saturating at +-448, as float_to_e4m3; a NaN takes float_to_e4m3's path, which keeps its sign (the
// instruction's canonical NaN may not).
__device__ __forceinline__ unsigned float2_to_e4m3x2(float lo, float hi) {
#if FP8_HARDWARE_ROUNDING && __CUDA_ARCH__ >= 890
  if (lo == lo && hi == hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));  // the first source: high byte
    return r;
  }
#endif
  return float_to_e4m3(lo) | float_to_e4m3(hi) << 8;
}

// Eight floats (already divided by the scale) -> eight e4m3 bytes, element i in byte i.
__device__ __forceinline__ uint2 float8_to_e4m3x8(const float (&f)[8]) {
  uint2 r;
  r.x = float2_to_e4m3x2(f[0], f[1]) | float2_to_e4m3x2(f[2], f[3]) << 16;
  r.y = float2_to_e4m3x2(f[4], f[5]) | float2_to_e4m3x2(f[6], f[7]) << 16;
  return r;
}
// FP8 linear activations (fp8_linear.cu, and the rms_norm / silu_mul forms in layer.cu that quantize their output):
// the larger of two |values|, keeping a NaN (NumPy's max does; fmaxf would drop it), and a row's scale from its
// amax: static_scale when positive (a checkpoint's input_scale), else amax / 448 IEEE-rounded, 1 when amax is 0 or
// NaN (offline_paged/ops/fp8_linear.py's fp8_scales).
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a >= b) ? a : b; }
__device__ __forceinline__ float fp8_row_scale(float amax, float static_scale) {
  if (static_scale > 0.f) return static_scale;
  return amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;  // NaN > 0 is false: 1
}

// x / scale as __fdiv_rn rounds it, for many x over one scale (a row's, or a layer's K or V scale): the reciprocal
// rounded once, then per value one product and two FMAs (Markstein's correction: q = x r, q + (x - scale q) r), about
// 4 instructions against __fdiv_rn's ~12 and its branch to a slow path. For scales in [2^-60, 2^60] it equals
// __fdiv_rn bit for bit wherever the quotient reaches e4m3's range (|x / scale| >= 2^-10), and below that both give
// an e4m3 zero of x's sign (checked on the host over every fp16 and bf16 value and 4e8 random floats, against 7,000
// scales, 1.3e9 quotients: session 56). Other scales, and quotients that are not finite (a NaN or infinite x, an
// overflow), take __fdiv_rn.
#ifndef FP8_DIVISOR_RECIPROCAL
#define FP8_DIVISOR_RECIPROCAL 1  // 0: every quotient through __fdiv_rn (the same bytes; for A/B timings)
#endif
struct Fp8Divisor {
  float scale, reciprocal;
  bool fast;
  __device__ __forceinline__ float operator()(float x) const {
#if FP8_DIVISOR_RECIPROCAL
    const float q = __fmul_rn(x, reciprocal);
    const float d = copysignf(__fmaf_rn(__fmaf_rn(-scale, q, x), reciprocal, q), x);
    if (fast && fabsf(d) <= 0x1.fffffep127f) return d;  // finite
#endif
    return __fdiv_rn(x, scale);
  }
};
__device__ __forceinline__ Fp8Divisor fp8_divisor(float scale) {
  return Fp8Divisor{scale, __frcp_rn(scale), scale >= 0x1p-60f && scale <= 0x1p60f};
}
#endif  // OFFLINE_PAGED_FP8_CUH
