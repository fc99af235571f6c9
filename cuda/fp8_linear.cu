// FP8 (e4m3fn) linear layers on CUDA: the two kernels around cuBLASLt's FP8 GEMM (offline_paged/ops/fp8_gemm.py).
// The NumPy reference is offline_paged/ops/fp8_linear.py (Fp8Linear); these kernels compute its definition.
// Element type T: fp16 (__half, names ending _f16) or bf16 (bf16_t, _bf16: its bits). fp32 arithmetic inside.
//
// quantize_rows_fp8_{f16,bf16} (per-token activation quantization; also per-output-channel weight quantization,
// a weight [N, K] being N rows of its K inputs)
//   x      [R, K] T contiguous
//   xq     [R, Kp] uint8 contiguous (e4m3fn bits), Kp >= K, Kp % 16 == 0 (cuBLASLt's FP8 rule): columns K..Kp-1
//          are written 0 (they pad the GEMM's inner dimension; a zero times anything adds nothing)
//   scales [R] float32, written: static_scale when static_scale > 0 (a checkpoint's input_scale), else
//          amax / 448 with amax = max_c |x[r, c]| (1 when amax is 0, or NaN: fp8_linear.fp8_scales' rule)
//   xq[r, c] = e4m3(x[r, c] / scales[r]) rounded to nearest even, saturating at +-448 (fp8.cuh), the division
//          as IEEE rounds it (fp8.cuh's Fp8Divisor): byte for byte quantize_rows / quantize_static of x as float32
//   Grid: x = row (strided by gridDim.x); block: QUANT_THREADS threads stride over the columns (a block-wide
//   max through warp shuffles and shared memory, then the quantizing pass).
//
// scale_fp8_output_{f16,bf16} (the epilogue cuBLASLt on sm_90 cannot do: per-row x per-column scales)
//   acc     [R, Np] float32 contiguous: the GEMM's accumulator sum_c xq[r, c] wq[j, c] (Np >= N); in the
//           scale_fp8_output_bf16acc_* forms bfloat16, those sums rounded once by the GEMM
//   x_scale [R] float32, w_scale [Np] float32
//   out     [R, N] T contiguous: (acc[r, j] * x_scale[r]) * w_scale[j], rounded to T once (the reference's order)
//   Grid: y = row (strided by gridDim.y); x * blockDim.x + threadIdx.x = column (strided).
//
// quantize_rows_fp8_vec_* / scale_fp8_output_vec_*: the same bytes and values, a thread taking 8 elements per 16-byte
// load (quantize: 8 e4m3 bytes per 8-byte store; scale: 4 columns per float4 load, 8 bytes of T per store). They need
// K % 8 == 0 (quantize) or N % 4 == 0 (scale; a bfloat16 accumulator's 4 entries in one 8-byte load) and aligned
// arrays; fp8_launcher.py checks and falls back to the scalar kernels. Grids as above, with the columns counted in vectors.
#include <cuda_fp16.h>
#include "fp8.cuh"

// A bfloat16 as its 16 bits (no cuda_bf16.h under NVRTC; see common.cuh).
struct __align__(2) bf16_t {
  unsigned short bits;
};

#define QUANT_THREADS 256

namespace {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float((unsigned)x.bits << 16); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r.bits) : "f"(x));
  return r;
}

// The largest |x| of a block's values (every thread passes its own partial), broadcast to all threads.
__device__ float block_max(float value) {
  __shared__ float warp_max[QUANT_THREADS / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value = nan_max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = value;
  __syncthreads();
  float result = warp_max[0];
#pragma unroll
  for (int w = 1; w < QUANT_THREADS / 32; ++w) result = nan_max(result, warp_max[w]);
  __syncthreads();  // warp_max is reused by the next row
  return result;
}

template <typename T>
__device__ void quantize_rows(const T* __restrict__ x, unsigned char* __restrict__ xq, float* __restrict__ scales,
                              long long num_rows, int width, int padded_width, float static_scale) {
  for (long long row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const T* in = x + row * width;
    unsigned char* out = xq + row * padded_width;
    float scale = static_scale;
    if (!(static_scale > 0.f)) {
      float amax = 0.f;
      for (int c = threadIdx.x; c < width; c += QUANT_THREADS) amax = nan_max(amax, fabsf(to_float(in[c])));
      scale = fp8_row_scale(block_max(amax), 0.f);
    }
    if (threadIdx.x == 0) scales[row] = scale;
    const Fp8Divisor divide = fp8_divisor(scale);
    for (int c = threadIdx.x; c < padded_width; c += QUANT_THREADS)
      out[c] = c < width ? (unsigned char)float_to_e4m3(divide(to_float(in[c]))) : 0;
  }
}

template <typename T, typename A>
__device__ void scale_output(const A* __restrict__ acc, const float* __restrict__ x_scale,
                             const float* __restrict__ w_scale, T* __restrict__ out, long long num_rows, int num_out,
                             int padded_out) {
  for (long long row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const float row_scale = x_scale[row];
    const A* in = acc + row * padded_out;
    T* dst = out + row * num_out;
    for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < num_out; col += gridDim.x * blockDim.x)
      dst[col] = from_float<T>(__fmul_rn(__fmul_rn(to_float(in[col]), row_scale), w_scale[col]));
  }
}

// Element i (0..7) of 8 T packed in a 16-byte vector: its 16 bits, and its value as a float.
__device__ __forceinline__ unsigned short element_bits(const uint4& v, int i) {
  const unsigned word = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  return (i & 1) ? word >> 16 : word & 0xffffu;
}
template <typename T>
__device__ __forceinline__ float element(const uint4& v, int i);
template <>
__device__ __forceinline__ float element<__half>(const uint4& v, int i) {
  return __half2float(__ushort_as_half(element_bits(v, i)));
}
template <>
__device__ __forceinline__ float element<bf16_t>(const uint4& v, int i) {
  return __uint_as_float((unsigned)element_bits(v, i) << 16);
}

// Two floats rounded to T, packed (the first in the low 16 bits).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  return __half_as_ushort(__float2half_rn(lo)) | (unsigned)__half_as_ushort(__float2half_rn(hi)) << 16;
}
template <>
__device__ __forceinline__ unsigned pack2<bf16_t>(float lo, float hi) {
  return from_float<bf16_t>(lo).bits | (unsigned)from_float<bf16_t>(hi).bits << 16;
}

template <typename T>
__device__ void quantize_rows_vec(const T* __restrict__ x, unsigned char* __restrict__ xq,
                                  float* __restrict__ scales, long long num_rows, int width, int padded_width,
                                  float static_scale) {
  const int vectors = width / 8, padded_vectors = padded_width / 8;
  for (long long row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const uint4* in = reinterpret_cast<const uint4*>(x + row * width);
    uint2* out = reinterpret_cast<uint2*>(xq + row * padded_width);
    float scale = static_scale;
    if (!(static_scale > 0.f)) {
      float amax = 0.f;
      for (int v = threadIdx.x; v < vectors; v += QUANT_THREADS) {
        const uint4 piece = in[v];
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = nan_max(amax, fabsf(element<T>(piece, i)));
      }
      scale = fp8_row_scale(block_max(amax), 0.f);
    }
    if (threadIdx.x == 0) scales[row] = scale;
    const Fp8Divisor divide = fp8_divisor(scale);
    for (int v = threadIdx.x; v < padded_vectors; v += QUANT_THREADS) {
      if (v < vectors) {
        const uint4 piece = in[v];
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = divide(element<T>(piece, i));
        out[v] = float8_to_e4m3x8(f);
      } else {
        out[v] = make_uint2(0u, 0u);
      }
    }
  }
}

// Four accumulator entries from one 16-byte (float32) or 8-byte (bfloat16) load.
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const bf16_t* p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}

template <typename T, typename A>
__device__ void scale_output_vec(const A* __restrict__ acc, const float* __restrict__ x_scale,
                                 const float* __restrict__ w_scale, T* __restrict__ out, long long num_rows,
                                 int num_out, int padded_out) {
  const float4* w4 = reinterpret_cast<const float4*>(w_scale);
  for (long long row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const float row_scale = x_scale[row];
    const A* in = acc + row * padded_out;
    uint2* dst = reinterpret_cast<uint2*>(out + row * num_out);
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < num_out / 4; v += gridDim.x * blockDim.x) {
      const float4 a = load4(in + 4 * v), w = w4[v];  // (acc x x_scale) x w_scale, the scalar kernel's order
      const float o0 = __fmul_rn(__fmul_rn(a.x, row_scale), w.x), o1 = __fmul_rn(__fmul_rn(a.y, row_scale), w.y);
      const float o2 = __fmul_rn(__fmul_rn(a.z, row_scale), w.z), o3 = __fmul_rn(__fmul_rn(a.w, row_scale), w.w);
      dst[v] = make_uint2(pack2<T>(o0, o1), pack2<T>(o2, o3));
    }
  }
}

}  // namespace

// scale_fp8_output{,_vec} for an accumulator of A (TAG: nothing for float32, _bf16acc for bfloat16).
#define FP8_SCALE_KERNELS(T, SUFFIX, A, TAG)                                                                         \
  extern "C" __global__ void scale_fp8_output##TAG##_##SUFFIX(const A* acc, const float* x_scale,                   \
                                                              const float* w_scale, T* out, long long num_rows,      \
                                                              int num_out, int padded_out) {                         \
    scale_output<T, A>(acc, x_scale, w_scale, out, num_rows, num_out, padded_out);                                   \
  }                                                                                                                  \
  extern "C" __global__ void scale_fp8_output_vec##TAG##_##SUFFIX(const A* acc, const float* x_scale,               \
                                                                  const float* w_scale, T* out, long long num_rows,  \
                                                                  int num_out, int padded_out) {                     \
    scale_output_vec<T, A>(acc, x_scale, w_scale, out, num_rows, num_out, padded_out);                               \
  }

#define FP8_LINEAR_KERNELS(T, SUFFIX)                                                                                \
  extern "C" __global__ void __launch_bounds__(QUANT_THREADS)                                                        \
      quantize_rows_fp8_##SUFFIX(const T* x, unsigned char* xq, float* scales, long long num_rows, int width,        \
                                 int padded_width, float static_scale) {                                             \
    quantize_rows<T>(x, xq, scales, num_rows, width, padded_width, static_scale);                                    \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(QUANT_THREADS)                                                        \
      quantize_rows_fp8_vec_##SUFFIX(const T* x, unsigned char* xq, float* scales, long long num_rows, int width,    \
                                     int padded_width, float static_scale) {                                         \
    quantize_rows_vec<T>(x, xq, scales, num_rows, width, padded_width, static_scale);                                \
  }                                                                                                                  \
  FP8_SCALE_KERNELS(T, SUFFIX, float, )                                                                              \
  FP8_SCALE_KERNELS(T, SUFFIX, bf16_t, _bf16acc)

FP8_LINEAR_KERNELS(__half, f16)
FP8_LINEAR_KERNELS(bf16_t, bf16)
