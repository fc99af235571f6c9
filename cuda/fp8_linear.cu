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
//          IEEE-rounded (__fdiv_rn): byte for byte quantize_rows / quantize_static of x as float32
//   Grid: x = row (strided by gridDim.x); block: QUANT_THREADS threads stride over the columns (a block-wide
//   max through warp shuffles and shared memory, then the quantizing pass).
//
// scale_fp8_output_{f16,bf16} (the epilogue cuBLASLt on sm_90 cannot do: per-row x per-column scales)
//   acc     [R, Np] float32 contiguous: the GEMM's accumulator sum_c xq[r, c] wq[j, c] (Np >= N)
//   x_scale [R] float32, w_scale [Np] float32
//   out     [R, N] T contiguous: (acc[r, j] * x_scale[r]) * w_scale[j], rounded to T once (the reference's order)
//   Grid: y = row (strided by gridDim.y); x * blockDim.x + threadIdx.x = column (strided).
#include <cuda_fp16.h>
#include "fp8.cuh"

// A bfloat16 as its 16 bits (no cuda_bf16.h under NVRTC; see common.cuh).
struct __align__(2) bf16_t {
  unsigned short bits;
};

#define QUANT_THREADS 256
#define FP8_MAX 448.f

namespace {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float((unsigned)x.bits << 16); }

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

// max of |values| that keeps a NaN (NumPy's max does; fmaxf would drop it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a >= b) ? a : b; }

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
      amax = block_max(amax);
      scale = amax > 0.f ? __fdiv_rn(amax, FP8_MAX) : 1.f;  // NaN > 0 is false: 1, as fp8_scales
    }
    if (threadIdx.x == 0) scales[row] = scale;
    for (int c = threadIdx.x; c < padded_width; c += QUANT_THREADS)
      out[c] = c < width ? (unsigned char)float_to_e4m3(__fdiv_rn(to_float(in[c]), scale)) : 0;
  }
}

template <typename T>
__device__ void scale_output(const float* __restrict__ acc, const float* __restrict__ x_scale,
                             const float* __restrict__ w_scale, T* __restrict__ out, long long num_rows, int num_out,
                             int padded_out) {
  for (long long row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const float row_scale = x_scale[row];
    const float* in = acc + row * padded_out;
    T* dst = out + row * num_out;
    for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < num_out; col += gridDim.x * blockDim.x)
      dst[col] = from_float<T>(__fmul_rn(__fmul_rn(in[col], row_scale), w_scale[col]));
  }
}

}  // namespace

#define FP8_LINEAR_KERNELS(T, SUFFIX)                                                                                \
  extern "C" __global__ void __launch_bounds__(QUANT_THREADS)                                                        \
      quantize_rows_fp8_##SUFFIX(const T* x, unsigned char* xq, float* scales, long long num_rows, int width,        \
                                 int padded_width, float static_scale) {                                             \
    quantize_rows<T>(x, xq, scales, num_rows, width, padded_width, static_scale);                                    \
  }                                                                                                                  \
  extern "C" __global__ void scale_fp8_output_##SUFFIX(const float* acc, const float* x_scale, const float* w_scale, \
                                                       T* out, long long num_rows, int num_out, int padded_out) {    \
    scale_output<T>(acc, x_scale, w_scale, out, num_rows, num_out, padded_out);                                      \
  }

FP8_LINEAR_KERNELS(__half, f16)
FP8_LINEAR_KERNELS(bf16_t, bf16)
