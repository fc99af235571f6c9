// The elementwise parts of a decoder layer: fused RMSNorm (+ residual add), RoPE, SiLU * mul.
// fp16 in and out, fp32 arithmetic inside, each output rounded to fp16 once.
//
// rms_norm
//   x, residual  [T, E] fp16 contiguous (residual may be null); weight [E] fp16
//   out          [T, E] fp16: h * rsqrt(mean(h^2) + eps) * weight, rounded once, with h = x (+ residual)
//   residual_out [T, E] fp16: h rounded to fp16 (the next layer's residual; vLLM convention)
//   Grid: x = token; block: 256 threads striding over E, a shared-memory tree sums the squares.
//
// rope (neox / HF rotate-half: dim j pairs with j + D/2)
//   q [T, H, D], k [T, Hkv, D] fp16, [H or Hkv, D] contiguous per token, token strides q_stride, k_stride
//   positions [T] int32; cos_sin [P, D] (fp16 or fp32: two kernels) = concat(cos, sin) over D/2 each
//   q_out [T, H, D], k_out [T, Hkv, D] fp16 contiguous (new arrays; the inputs are left alone)
//   Grid: x = token; block: 128 threads striding over (H + Hkv) * D/2 pairs.
//
// silu_mul
//   gate_up [T, 2I] fp16 contiguous (gate = first I columns, up = last I); out [T, I] fp16
//   Grid-stride loop over the T*I outputs, one per thread.
#include <cuda_fp16.h>

extern "C" __global__ void rms_norm(const __half* x, const __half* residual, const __half* weight, __half* out,
                                    __half* residual_out, int hidden, float eps) {
  __shared__ float partial[256];
  const size_t row = (size_t)blockIdx.x * hidden;
  float sum = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    __half h = x[row + i];
    if (residual != nullptr) h = __hadd(h, residual[row + i]);
    residual_out[row + i] = h;
    const float f = __half2float(h);
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
    out[row + i] = __float2half(__half2float(residual_out[row + i]) * inv_rms * __half2float(weight[i]));
  }
}

template <typename CacheT>
__device__ void rope_impl(const __half* q, const __half* k, const int* positions, const CacheT* cos_sin,
                          __half* q_out, __half* k_out, long long q_stride, long long k_stride, int num_heads,
                          int num_kv_heads, int head_dim) {
  const int token = blockIdx.x;
  const int half_dim = head_dim / 2;
  const CacheT* table = cos_sin + (size_t)positions[token] * head_dim;
  const int q_pairs = num_heads * half_dim;
  for (int i = threadIdx.x; i < (num_heads + num_kv_heads) * half_dim; i += blockDim.x) {
    const bool is_q = i < q_pairs;
    const int pair = is_q ? i : i - q_pairs;
    const int head = pair / half_dim, j = pair % half_dim;
    const __half* src = is_q ? q + token * q_stride : k + token * k_stride;
    __half* dst = is_q ? q_out + (size_t)token * num_heads * head_dim : k_out + (size_t)token * num_kv_heads * head_dim;
    const float x1 = __half2float(src[head * head_dim + j]);
    const float x2 = __half2float(src[head * head_dim + j + half_dim]);
    const float c = static_cast<float>(table[j]), s = static_cast<float>(table[j + half_dim]);
    dst[head * head_dim + j] = __float2half(x1 * c - x2 * s);
    dst[head * head_dim + j + half_dim] = __float2half(x2 * c + x1 * s);
  }
}

#define DEFINE_ROPE(NAME, CACHE_T)                                                                           \
  extern "C" __global__ void NAME(const __half* q, const __half* k, const int* positions,                   \
                                  const CACHE_T* cos_sin, __half* q_out, __half* k_out, long long q_stride,  \
                                  long long k_stride, int num_heads, int num_kv_heads, int head_dim) {      \
    rope_impl<CACHE_T>(q, k, positions, cos_sin, q_out, k_out, q_stride, k_stride, num_heads, num_kv_heads, \
                       head_dim);                                                                           \
  }
DEFINE_ROPE(rope_f16_cache, __half)
DEFINE_ROPE(rope_f32_cache, float)

extern "C" __global__ void silu_mul(const __half* gate_up, __half* out, long long num_tokens, int inter) {
  const long long total = num_tokens * inter;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / inter, j = i % inter;
    const float gate = __half2float(gate_up[t * 2 * inter + j]);
    const float up = __half2float(gate_up[t * 2 * inter + inter + j]);
    out[i] = __float2half(gate / (1.f + __expf(-gate)) * up);
  }
}
