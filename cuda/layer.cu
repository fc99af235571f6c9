// The elementwise parts of a decoder layer: fused RMSNorm (+ residual add), RoPE, SiLU * mul.
// Element type T: every kernel exists for fp16 (__half, names ending _f16) and bf16 (bf16_t, _bf16: the
// bits of a bfloat16, converted with PTX cvt, no cuda_bf16.h needed). T in and out, fp32 arithmetic
// inside, each output rounded to T once (round to nearest even).
//
// rms_norm_{f16,bf16}
//   x, residual  [T, E] T contiguous (residual may be null); weight [E] T
//   out          [T, E] T: h * rsqrt(mean(h^2) + eps) * weight, rounded once, with h = x (+ residual)
//   residual_out [T, E] T: h rounded to T (the next layer's residual; vLLM convention)
//   Grid: x = token; block: 256 threads striding over E, a shared-memory tree sums the squares.
//
// rope_{same,f32}_cache_{f16,bf16} (neox / HF rotate-half: dim j pairs with j + D/2)
//   q [T, H, D], k [T, Hkv, D] T, [H or Hkv, D] contiguous per token, token strides q_stride, k_stride
//   positions [T] int32; cos_sin [P, D] (T: "same", or fp32) = concat(cos, sin) over D/2 each
//   q_out [T, H, D], k_out [T, Hkv, D] T contiguous (new arrays; the inputs are left alone)
//   Grid: x = token; block: 128 threads striding over (H + Hkv) * D/2 pairs.
//
// add_bias_{f16,bf16}
//   x [T, N] T contiguous, updated in place: x[t, j] + bias[j] rounded once; bias [N] T.
//   Grid-stride loop over the T*N entries. (A CuPy `+` on bf16 arrays broke CUDA-graph capture.)
//
// silu_mul_{f16,bf16}
//   gate_up [T, 2I] T contiguous (gate = first I columns, up = last I); out [T, I] T
//   Grid-stride loop over the T*I outputs, one per thread.
#include <cuda_fp16.h>

// A bfloat16 as its 16 bits (see attention.cu: NVRTC may lack a matching cuda_bf16.h).
struct __align__(2) bf16_t {
  unsigned short bits;
};

namespace {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float((unsigned)x.bits << 16); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r.bits) : "f"(x));
  return r;
}

// a + b rounded once to the type. For bf16 the fp32 sum is exact whenever it can matter: two 8-bit
// significands whose exponents differ by < 16 fit in fp32's 24 bits, and a smaller addend is below
// 1/256 ulp of the larger, which both roundings then return.
__device__ __forceinline__ __half add_rounded(__half a, __half b) { return __hadd(a, b); }
__device__ __forceinline__ bf16_t add_rounded(bf16_t a, bf16_t b) {
  return from_float<bf16_t>(to_float(a) + to_float(b));
}

template <typename T>
__device__ void rms_norm_impl(const T* x, const T* residual, const T* weight, T* out, T* residual_out,
                              int hidden, float eps) {
  __shared__ float partial[256];
  const size_t row = (size_t)blockIdx.x * hidden;
  float sum = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    T h = x[row + i];
    if (residual != nullptr) h = add_rounded(h, residual[row + i]);  // the exact sum rounded once to T
    residual_out[row + i] = h;
    const float f = to_float(h);
    sum += f * f;
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = blockDim.x / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  const float inv_rms = rsqrtf(partial[0] / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    out[row + i] = from_float<T>(to_float(residual_out[row + i]) * inv_rms * to_float(weight[i]));
  }
}

template <typename T, typename CacheT>
__device__ void rope_impl(const T* q, const T* k, const int* positions, const CacheT* cos_sin, T* q_out,
                          T* k_out, long long q_stride, long long k_stride, int num_heads, int num_kv_heads,
                          int head_dim) {
  const int token = blockIdx.x;
  const int half_dim = head_dim / 2;
  const CacheT* table = cos_sin + (size_t)positions[token] * head_dim;
  const int q_pairs = num_heads * half_dim;
  for (int i = threadIdx.x; i < (num_heads + num_kv_heads) * half_dim; i += blockDim.x) {
    const bool is_q = i < q_pairs;
    const int pair = is_q ? i : i - q_pairs;
    const int head = pair / half_dim, j = pair % half_dim;
    const T* src = is_q ? q + token * q_stride : k + token * k_stride;
    T* dst = is_q ? q_out + (size_t)token * num_heads * head_dim : k_out + (size_t)token * num_kv_heads * head_dim;
    const float x1 = to_float(src[head * head_dim + j]);
    const float x2 = to_float(src[head * head_dim + j + half_dim]);
    const float c = to_float(table[j]), s = to_float(table[j + half_dim]);
    dst[head * head_dim + j] = from_float<T>(x1 * c - x2 * s);
    dst[head * head_dim + j + half_dim] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T>
__device__ void silu_mul_impl(const T* gate_up, T* out, long long num_tokens, int inter) {
  const long long total = num_tokens * inter;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / inter, j = i % inter;
    const float gate = to_float(gate_up[t * 2 * inter + j]);
    const float up = to_float(gate_up[t * 2 * inter + inter + j]);
    out[i] = from_float<T>(gate / (1.f + __expf(-gate)) * up);
  }
}

template <typename T>
__device__ void add_bias_impl(T* x, const T* bias, long long total, int width) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    x[i] = add_rounded(x[i], bias[i % width]);
  }
}

}  // namespace

#define DEFINE_LAYER_KERNELS(T, SUFFIX)                                                                      \
  extern "C" __global__ void rms_norm_##SUFFIX(const T* x, const T* residual, const T* weight, T* out,      \
                                               T* residual_out, int hidden, float eps) {                    \
    rms_norm_impl<T>(x, residual, weight, out, residual_out, hidden, eps);                                  \
  }                                                                                                         \
  extern "C" __global__ void rope_same_cache_##SUFFIX(const T* q, const T* k, const int* positions,       \
                                                        const T* cos_sin, T* q_out, T* k_out,               \
                                                        long long q_stride, long long k_stride,             \
                                                        int num_heads, int num_kv_heads, int head_dim) {    \
    rope_impl<T, T>(q, k, positions, cos_sin, q_out, k_out, q_stride, k_stride, num_heads, num_kv_heads,    \
                    head_dim);                                                                              \
  }                                                                                                         \
  extern "C" __global__ void rope_f32_cache_##SUFFIX(const T* q, const T* k, const int* positions,        \
                                                       const float* cos_sin, T* q_out, T* k_out,            \
                                                       long long q_stride, long long k_stride,              \
                                                       int num_heads, int num_kv_heads, int head_dim) {     \
    rope_impl<T, float>(q, k, positions, cos_sin, q_out, k_out, q_stride, k_stride, num_heads,              \
                        num_kv_heads, head_dim);                                                            \
  }                                                                                                         \
  extern "C" __global__ void silu_mul_##SUFFIX(const T* gate_up, T* out, long long num_tokens, int inter) { \
    silu_mul_impl<T>(gate_up, out, num_tokens, inter);                                                      \
  }                                                                                                         \
  extern "C" __global__ void add_bias_##SUFFIX(T* x, const T* bias, long long total, int width) {           \
    add_bias_impl<T>(x, bias, total, width);                                                                \
  }
DEFINE_LAYER_KERNELS(__half, f16)
DEFINE_LAYER_KERNELS(bf16_t, bf16)
