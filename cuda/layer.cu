// The elementwise parts of a decoder layer: fused RMSNorm (+ residual add), RoPE (alone, or fused with
// the KV-cache write), SiLU * mul.
// Element type T: every kernel exists for fp16 (__half, names ending _f16) and bf16 (bf16_t, _bf16: the
// bits of a bfloat16, converted with PTX cvt, no cuda_bf16.h needed). T in and out, fp32 arithmetic
// inside, each output rounded to T once (round to nearest even).
//
// rms_norm_{f16,bf16}
//   x, residual  [T, E] T contiguous (residual may be null); weight [E] T
//   out          [T, E] T: h * rsqrt(mean(h^2) + eps) * weight, rounded once, with h = x (+ residual)
//   residual_out [T, E] T: h rounded to T (the next layer's residual; vLLM convention)
//   Grid: x = token; block: a multiple of 32 threads (<= 1024). Vector path (E % 8 == 0, all pointers
//   16-byte aligned): 8-element chunks c = threadIdx.x + n * blockDim.x, the first RMS_HELD per thread
//   kept in registers, so x and residual are read once; warp-shuffle sum of squares. Else one element
//   per step, and the output pass reads back the residual_out entries the same thread wrote.
//
// rope_{same,f32}_cache_{f16,bf16} (neox / HF rotate-half: dim j pairs with j + D/2)
//   q [T, H, D], k [T, Hkv, D] T, [H or Hkv, D] contiguous per token, token strides q_stride, k_stride
//   positions [T] int32; cos_sin [P, D] (T: "same", or fp32) = concat(cos, sin) over D/2 each
//   q_out [T, H, D], k_out [T, Hkv, D] T contiguous (new arrays; the inputs are left alone)
//   Grid: x = token; block threads stride over (H + Hkv) * D/2 pairs, or over (H + Hkv) * D/16 units of
//   8 consecutive pairs when D/2 % 8 == 0, both strides % 8 == 0 and all pointers are 16-byte aligned.
//
// head_rms_norm_{f16,bf16} (Qwen3's q_norm and k_norm: RMSNorm of every head over D, q's and k's in one launch)
//   q [T, H, D], k [T, Hkv, D] T, [heads, D] contiguous per token, token strides q_stride, k_stride
//   q_weight, k_weight [D] T
//   q_out [T, H, D], k_out [T, Hkv, D] T contiguous (new): each head x * rsqrt(mean(x^2) + eps) * weight,
//   rounded once (rms_norm's arithmetic over a row of D)
//   Grid: x = token; block: warps stride over the H + Hkv heads, one warp per head, warp-shuffle sum of
//   squares; lanes stride over the head's 8-element chunks when D % 8 == 0, both strides % 8 == 0 and all
//   pointers are 16-byte aligned, else over its elements. The second pass reads the head again (L1).
//
// rope_write_kv_{same,f32}_cache_{f16,bf16} (rope, then cache.cu's write_kv, in one kernel)
//   q, positions, cos_sin as rope; k, v [T, Hkv, D] T, [Hkv, D] contiguous per token, token strides
//   k_stride, v_stride (q, k, v are usually views into one fused qkv row)
//   slot_mapping [T] int32: token t's K/V go to row slot_mapping[t] of the caches; negative: no K/V write
//   q_out        [T, H, D] T contiguous (new): rotated q, bit for bit rope's (the same rotate8/rotate1)
//   k_cache, v_cache [N, B, Hkv, D] T contiguous, row s = slot s of [N*B, Hkv, D]: rotated k, v as is
//   Grid: x = token; block threads stride over H * D/2 q pairs, then (slot >= 0 only) Hkv * D/2 k pairs and
//   Hkv * D v elements; on the vector path (rope's condition, plus v_stride % 8 == 0 and v, k_cache, v_cache
//   16-byte aligned) over H * D/16 q units, Hkv * D/16 k units (8 pairs each) and Hkv * D/8 v 16-byte copies.
//
// rope_write_kv_fp8_{same,f32}_cache_{f16,bf16} (the FP8 KV cache; cuda/fp8.cuh)
//   as rope_write_kv, but k_cache, v_cache [N, B, Hkv, D] are uint8 (e4m3fn bits) and kv_scale [2] fp32 on
//   the device = (k_scale, v_scale): the rotated k and v are rounded to T, divided by their scale and
//   quantized (ties to even, saturating at +-448), so the bytes equal rope + write_kv_fp8's.
//
// rope_write_kv{,_fp8}_product{,_bf16acc}_{f16,bf16} (the qkv projection's FP8 product, its epilogue folded in)
//   acc [T, Np] (fp32, or bf16 for _bf16acc), acc_x_scale [T], acc_w_scale [Np] fp32: q, k, v are columns
//   [0, H D), [H D, (H + Hkv) D), [(H + Hkv) D, (H + 2 Hkv) D) of T((acc x x_scale) x w_scale) (RowOfFp8Product);
//   cos_sin [P, D] T; the rest as rope_write_kv(_fp8), byte for byte scale_fp8_output then that kernel.
//   Vector path only (D/2 % 8 == 0, Np % 8 == 0, 16-byte aligned arrays; the launcher checks), its units.
//
// add_bias_{f16,bf16}
//   x [T, N] T contiguous, updated in place: x[t, j] + bias[j] rounded once; bias [N] T.
//   Grid-stride loop over the T*N entries. (A CuPy `+` on bf16 arrays broke CUDA-graph capture.)
//
// silu_mul_{f16,bf16}
//   gate_up [T, 2I] T contiguous (gate = first I columns, up = last I); out [T, I] T
//   Grid: y = token (strided by gridDim.y), x * blockDim.x + threadIdx.x = column unit (strided): 8
//   columns when I % 8 == 0 and both pointers are 16-byte aligned, else one.
#include <cuda_fp16.h>
#include "fp8.cuh"

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

// Eight elements moved as one 16-byte access (the vector paths below; taken only when the row length is a
// multiple of 8 and every base pointer and row stride keeps 16-byte alignment, tested uniformly per launch).
constexpr int VEC = 8;

template <typename T>
union Pack8 {
  uint4 raw;
  T v[VEC];
  __device__ Pack8() {}  // a union of a type with constructors (__half) needs its own
};

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

template <typename T>
__device__ __forceinline__ Pack8<T> load8(const T* p) {
  Pack8<T> r;
  r.raw = *reinterpret_cast<const uint4*>(p);
  return r;
}

__device__ __forceinline__ unsigned bits_of(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned bits_of(bf16_t x) { return x.bits; }

// One 16-byte store, spelled in PTX: a plain uint4 store of freshly packed elements was split by the
// compiler into four 4-byte stores in silu_mul. p is 16-byte aligned (callers check).
template <typename T>
__device__ __forceinline__ void store8(T* p, const Pack8<T>& r) {
  asm volatile("st.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(bits_of(r.v[0]) | bits_of(r.v[1]) << 16),
               "r"(bits_of(r.v[2]) | bits_of(r.v[3]) << 16), "r"(bits_of(r.v[4]) | bits_of(r.v[5]) << 16),
               "r"(bits_of(r.v[6]) | bits_of(r.v[7]) << 16)
               : "memory");
}

template <typename T>
__device__ __forceinline__ void load8_float(const T* p, float (&f)[VEC]) {
  const Pack8<T> r = load8(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) f[i] = to_float(r.v[i]);
}
__device__ __forceinline__ void load8_float(const float* p, float (&f)[VEC]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void store8_float(T* p, const float (&f)[VEC]) {
  Pack8<T> r;
#pragma unroll
  for (int i = 0; i < VEC; ++i) r.v[i] = from_float<T>(f[i]);
  store8(p, r);
}

// Sum of `value` over the warp, returned to every lane.
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Sum of `value` over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ __forceinline__ float block_sum(float value) {
  __shared__ float warp_sums[32];
  value = warp_sum(value);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = lane < num_warps ? warp_sums[lane] : 0.f;
  return warp_sum(value);
}

// Where a kernel reads its input row from (the block's row; `chunk` needs col % 8 == 0 and the source's vector
// alignment, which `aligned` reports):
// RowOf16: a 16-bit activation row.
template <typename T>
struct RowOf16 {
  const T* p;
  __device__ __forceinline__ Pack8<T> chunk(int col) const { return load8(p + col); }
  __device__ __forceinline__ T one(int col) const { return p[col]; }
  __device__ __forceinline__ bool aligned() const { return aligned16(p); }
};

// RowOfFp8Product: a row of an FP8 GEMM's product before its scale epilogue (offline_paged/ops/cuda_fp8_linear.py's
// Fp8Product): acc [.., Np] of A (float32, or bfloat16 when the GEMM rounded its sums to it), the row's x_scale,
// w_scale [Np]; element j is T((float(acc[j]) x_scale) x w_scale[j]) rounded once, as fp8_linear.cu's
// scale_fp8_output writes it, bit for bit.
template <typename T, typename A>
struct RowOfFp8Product {
  const A* acc;
  float x_scale;
  const float* w_scale;
  __device__ __forceinline__ T scaled(float a, float w) const {
    return from_float<T>(__fmul_rn(__fmul_rn(a, x_scale), w));
  }
  __device__ __forceinline__ Pack8<T> chunk(int col) const {
    float a[VEC], w[VEC];
    load8_float(acc + col, a);
    load8_float(w_scale + col, w);
    Pack8<T> r;
#pragma unroll
    for (int i = 0; i < VEC; ++i) r.v[i] = scaled(a[i], w[i]);
    return r;
  }
  __device__ __forceinline__ T one(int col) const { return scaled(to_float(acc[col]), w_scale[col]); }
  __device__ __forceinline__ bool aligned() const { return aligned16(acc) && aligned16(w_scale); }
};

// Vector chunks of a row each thread keeps in registers between the sum and the output pass
// (RMS_HELD * blockDim.x * 8 elements: 32768 at 1024 threads); chunks past that are read back from
// residual_out, which the same thread wrote.
constexpr int RMS_HELD = 4;

template <typename T, typename X>
__device__ __forceinline__ Pack8<T> rms_residual8(const X& x, const T* residual, size_t at, int col, float& sum) {
  Pack8<T> h = x.chunk(col);
  if (residual != nullptr) {
    const Pack8<T> r = load8(residual + at);
#pragma unroll
    for (int i = 0; i < VEC; ++i) h.v[i] = add_rounded(h.v[i], r.v[i]);  // the exact sum rounded once to T
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float f = to_float(h.v[i]);
    sum += f * f;
  }
  return h;
}

// The normed output of 8 residual entries h, rounded to T (weight entries col..col+7).
template <typename T>
__device__ __forceinline__ Pack8<T> rms_normed8(const Pack8<T>& h, const T* weight, int col, float inv_rms) {
  const Pack8<T> w = load8(weight + col);
  Pack8<T> o;
#pragma unroll
  for (int i = 0; i < VEC; ++i) o.v[i] = from_float<T>(to_float(h.v[i]) * inv_rms * to_float(w.v[i]));
  return o;
}

// One entry of it (the scalar path), as a float.
template <typename T>
__device__ __forceinline__ float rms_normed1(T h, T w, float inv_rms) {
  return to_float(from_float<T>(to_float(h) * inv_rms * to_float(w)));
}

// The vector path's first pass of a row (x: the row's source; `row`: its first element's index in residual and
// residual_out): h = x (+ residual) rounded to T, written to residual_out, the thread's first RMS_HELD chunks kept
// in `held`; returns 1 / rms of the row (block-wide).
template <typename T, typename X>
__device__ __forceinline__ float rms_first_pass8(const X& x, const T* residual, T* residual_out, size_t row,
                                                 int hidden, float eps, Pack8<T> (&held)[RMS_HELD]) {
  const int chunks = hidden / VEC;
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < RMS_HELD; ++n) {  // all loads first (store8 is an asm barrier to reordering)
    const int c = threadIdx.x + n * blockDim.x;
    if (c < chunks) held[n] = rms_residual8(x, residual, row + (size_t)c * VEC, c * VEC, sum);
  }
#pragma unroll
  for (int n = 0; n < RMS_HELD; ++n) {
    const int c = threadIdx.x + n * blockDim.x;
    if (c < chunks) store8(residual_out + row + (size_t)c * VEC, held[n]);
  }
  for (int c = threadIdx.x + RMS_HELD * blockDim.x; c < chunks; c += blockDim.x) {
    store8(residual_out + row + (size_t)c * VEC, rms_residual8(x, residual, row + (size_t)c * VEC, c * VEC, sum));
  }
  return rsqrtf(block_sum(sum) / hidden + eps);
}

// The scalar path's first pass: as rms_first_pass8, one element per step (the output pass reads back the
// residual_out entries the same thread wrote).
template <typename T, typename X>
__device__ __forceinline__ float rms_first_pass1(const X& x, const T* residual, T* residual_out, size_t row,
                                                 int hidden, float eps) {
  float sum = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    T h = x.one(i);
    if (residual != nullptr) h = add_rounded(h, residual[row + i]);  // the exact sum rounded once to T
    residual_out[row + i] = h;
    const float f = to_float(h);
    sum += f * f;
  }
  return rsqrtf(block_sum(sum) / hidden + eps);
}

template <typename T>
__device__ void rms_norm_impl(const T* x, const T* residual, const T* weight, T* out, T* residual_out,
                              int hidden, float eps) {
  const size_t row = (size_t)blockIdx.x * hidden;
  const bool vec = hidden % VEC == 0 && aligned16(x) && aligned16(residual) && aligned16(weight) &&
                   aligned16(out) && aligned16(residual_out);
  if (vec) {
    const int chunks = hidden / VEC;
    Pack8<T> held[RMS_HELD];
    const float inv_rms = rms_first_pass8(RowOf16<T>{x + row}, residual, residual_out, row, hidden, eps, held);
#pragma unroll
    for (int n = 0; n < RMS_HELD; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < chunks) store8(out + row + (size_t)c * VEC, rms_normed8(held[n], weight, c * VEC, inv_rms));
    }
    for (int c = threadIdx.x + RMS_HELD * blockDim.x; c < chunks; c += blockDim.x) {
      const Pack8<T> h = load8(residual_out + row + (size_t)c * VEC);
      store8(out + row + (size_t)c * VEC, rms_normed8(h, weight, c * VEC, inv_rms));
    }
    return;
  }
  const float inv_rms = rms_first_pass1(RowOf16<T>{x + row}, residual, residual_out, row, hidden, eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {  // each thread reads back what it wrote
    out[row + i] = from_float<T>(to_float(residual_out[row + i]) * inv_rms * to_float(weight[i]));
  }
}

// Rotate-half RoPE of 8 consecutive pairs: src/dst point at element j of a head, cs at the table row's
// entry j (cos; sin D/2 later). rope and rope_write_kv both rotate through these two helpers, so their
// arithmetic (and the compiler's contraction of it) is one and the same: their outputs agree bit for bit.
// (The FP8 write rotates through rotate8_values / rotate1_values, the same arithmetic, then rounds to T
// before it quantizes: its cache bytes are those of rope's k written by write_kv_fp8.)
// (rotate8_pack: the same from the 8 elements at j and at j + D/2 already loaded, for sources that are not a
// plain array: rope_write_kv_product_impl.)
template <typename T, typename CacheT>
__device__ __forceinline__ void rotate8_pack(const Pack8<T>& a, const Pack8<T>& b, const CacheT* cs, int half_dim,
                                             float (&y1)[VEC], float (&y2)[VEC]) {
  float x1[VEC], x2[VEC], c[VEC], s[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) x1[i] = to_float(a.v[i]), x2[i] = to_float(b.v[i]);
  load8_float(cs, c);
  load8_float(cs + half_dim, s);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    y1[i] = x1[i] * c[i] - x2[i] * s[i];
    y2[i] = x2[i] * c[i] + x1[i] * s[i];
  }
}

template <typename T, typename CacheT>
__device__ __forceinline__ void rotate8_values(const T* src, const CacheT* cs, int half_dim, float (&y1)[VEC],
                                               float (&y2)[VEC]) {
  rotate8_pack(load8(src), load8(src + half_dim), cs, half_dim, y1, y2);
}

template <typename T, typename CacheT>
__device__ __forceinline__ void rotate8(const T* src, const CacheT* cs, int half_dim, T* dst) {
  float y1[VEC], y2[VEC];
  rotate8_values(src, cs, half_dim, y1, y2);
  store8_float(dst, y1);
  store8_float(dst + half_dim, y2);
}

// The same for one pair (the scalar paths).
template <typename T, typename CacheT>
__device__ __forceinline__ void rotate1_values(const T* src, const CacheT* cs, int half_dim, float& y1, float& y2) {
  const float x1 = to_float(src[0]), x2 = to_float(src[half_dim]);
  const float c = to_float(cs[0]), s = to_float(cs[half_dim]);
  y1 = x1 * c - x2 * s;
  y2 = x2 * c + x1 * s;
}

template <typename T, typename CacheT>
__device__ __forceinline__ void rotate1(const T* src, const CacheT* cs, int half_dim, T* dst) {
  float y1, y2;
  rotate1_values(src, cs, half_dim, y1, y2);
  dst[0] = from_float<T>(y1);
  dst[half_dim] = from_float<T>(y2);
}

// FP8 cache stores (cuda/fp8.cuh): each value rounded to T first (what the 16-bit cache would hold),
// then divided by the scale and quantized to e4m3.
template <typename T>
__device__ __forceinline__ unsigned quantize1(float y, const Fp8Divisor& scale) {
  return float_to_e4m3(scale(to_float(from_float<T>(y))));
}

template <typename T>
__device__ __forceinline__ void store8_fp8(unsigned char* p, const float (&y)[VEC], const Fp8Divisor& scale) {
  float f[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) f[i] = scale(to_float(from_float<T>(y[i])));
  *reinterpret_cast<uint2*>(p) = float8_to_e4m3x8(f);
}

template <typename T>
__device__ void head_rms_norm_impl(const T* q, const T* k, const T* q_weight, const T* k_weight, T* q_out,
                                   T* k_out, long long q_stride, long long k_stride, int num_heads,
                                   int num_kv_heads, int head_dim, float eps) {
  const int token = blockIdx.x;
  const int lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const bool vec = head_dim % VEC == 0 && q_stride % VEC == 0 && k_stride % VEC == 0 && aligned16(q) &&
                   aligned16(k) && aligned16(q_weight) && aligned16(k_weight) && aligned16(q_out) &&
                   aligned16(k_out);
  for (int head = threadIdx.x / 32; head < num_heads + num_kv_heads; head += num_warps) {  // warp-uniform
    const bool is_q = head < num_heads;
    const int h = is_q ? head : head - num_heads;
    const T* src = is_q ? q + token * q_stride + (size_t)h * head_dim : k + token * k_stride + (size_t)h * head_dim;
    const T* weight = is_q ? q_weight : k_weight;
    T* dst = is_q ? q_out + ((size_t)token * num_heads + h) * head_dim
                  : k_out + ((size_t)token * num_kv_heads + h) * head_dim;
    float sum = 0.f;
    if (vec) {
      for (int c = lane * VEC; c < head_dim; c += 32 * VEC) {
        float x[VEC];
        load8_float(src + c, x);
#pragma unroll
        for (int i = 0; i < VEC; ++i) sum += x[i] * x[i];
      }
      const float inv_rms = rsqrtf(warp_sum(sum) / head_dim + eps);
      for (int c = lane * VEC; c < head_dim; c += 32 * VEC) store8(dst + c, rms_normed8(load8(src + c), weight, c, inv_rms));
    } else {
      for (int i = lane; i < head_dim; i += 32) {
        const float x = to_float(src[i]);
        sum += x * x;
      }
      const float inv_rms = rsqrtf(warp_sum(sum) / head_dim + eps);
      for (int i = lane; i < head_dim; i += 32) dst[i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
    }
  }
}

template <typename T, typename CacheT>
__device__ void rope_impl(const T* q, const T* k, const int* positions, const CacheT* cos_sin, T* q_out,
                          T* k_out, long long q_stride, long long k_stride, int num_heads, int num_kv_heads,
                          int head_dim) {
  const int token = blockIdx.x;
  const int half_dim = head_dim / 2;
  const CacheT* table = cos_sin + (size_t)positions[token] * head_dim;
  const T* q_row = q + token * q_stride;
  const T* k_row = k + token * k_stride;
  T* q_out_row = q_out + (size_t)token * num_heads * head_dim;
  T* k_out_row = k_out + (size_t)token * num_kv_heads * head_dim;
  const bool vec = half_dim % VEC == 0 && q_stride % VEC == 0 && k_stride % VEC == 0 && aligned16(q) &&
                   aligned16(k) && aligned16(cos_sin) && aligned16(q_out) && aligned16(k_out);
  if (vec) {  // unit = 8 consecutive pairs (j .. j+7 with j + D/2 .. j+7 + D/2) of one head
    const int units_per_head = half_dim / VEC;
    const int q_units = num_heads * units_per_head;
    for (int u = threadIdx.x; u < (num_heads + num_kv_heads) * units_per_head; u += blockDim.x) {
      const bool is_q = u < q_units;
      const int unit = is_q ? u : u - q_units;
      const int head = unit / units_per_head, j = (unit - head * units_per_head) * VEC;
      rotate8((is_q ? q_row : k_row) + head * head_dim + j, table + j, half_dim,
              (is_q ? q_out_row : k_out_row) + head * head_dim + j);
    }
    return;
  }
  const int q_pairs = num_heads * half_dim;
  for (int i = threadIdx.x; i < (num_heads + num_kv_heads) * half_dim; i += blockDim.x) {
    const bool is_q = i < q_pairs;
    const int pair = is_q ? i : i - q_pairs;
    const int head = pair / half_dim, j = pair % half_dim;
    rotate1((is_q ? q_row : k_row) + head * head_dim + j, table + j, half_dim,
            (is_q ? q_out_row : k_out_row) + head * head_dim + j);
  }
}

// rope followed by write_kv in one pass: q rotated into q_out, k rotated straight into its cache row,
// v copied there unchanged; a token with a negative slot has only its q rotated.
template <typename T, typename CacheT>
__device__ void rope_write_kv_impl(const T* q, const T* k, const T* v, const int* positions, const CacheT* cos_sin,
                                   const int* slot_mapping, T* q_out, T* k_cache, T* v_cache, long long q_stride,
                                   long long k_stride, long long v_stride, int num_heads, int num_kv_heads,
                                   int head_dim) {
  const int token = blockIdx.x;
  const int half_dim = head_dim / 2;
  const int slot = slot_mapping[token];
  const int kv_heads = slot < 0 ? 0 : num_kv_heads;  // KV heads this token writes
  const CacheT* table = cos_sin + (size_t)positions[token] * head_dim;
  const T* q_row = q + token * q_stride;
  const T* k_row = k + token * k_stride;
  const T* v_row = v + token * v_stride;
  T* q_out_row = q_out + (size_t)token * num_heads * head_dim;
  const size_t cache_row = (size_t)(slot < 0 ? 0 : slot) * num_kv_heads * head_dim;
  T* k_dst = k_cache + cache_row;
  T* v_dst = v_cache + cache_row;
  const bool vec = half_dim % VEC == 0 && q_stride % VEC == 0 && k_stride % VEC == 0 && v_stride % VEC == 0 &&
                   aligned16(q) && aligned16(k) && aligned16(v) && aligned16(cos_sin) && aligned16(q_out) &&
                   aligned16(k_cache) && aligned16(v_cache);
  if (vec) {  // units: q's and k's 8-pair rotations (as rope_impl), then v's 8-element copies
    const int units_per_head = half_dim / VEC;
    const int q_units = num_heads * units_per_head;
    const int rotations = q_units + kv_heads * units_per_head;
    const int units = rotations + kv_heads * head_dim / VEC;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      if (u < rotations) {
        const bool is_q = u < q_units;
        const int unit = is_q ? u : u - q_units;
        const int head = unit / units_per_head, j = (unit - head * units_per_head) * VEC;
        rotate8((is_q ? q_row : k_row) + head * head_dim + j, table + j, half_dim,
                (is_q ? q_out_row : k_dst) + head * head_dim + j);
      } else {
        const int at = (u - rotations) * VEC;
        *reinterpret_cast<uint4*>(v_dst + at) = *reinterpret_cast<const uint4*>(v_row + at);
      }
    }
    return;
  }
  const int q_pairs = num_heads * half_dim;
  const int rotations = q_pairs + kv_heads * half_dim;
  for (int i = threadIdx.x; i < rotations + kv_heads * head_dim; i += blockDim.x) {
    if (i < rotations) {
      const bool is_q = i < q_pairs;
      const int pair = is_q ? i : i - q_pairs;
      const int head = pair / half_dim, j = pair % half_dim;
      rotate1((is_q ? q_row : k_row) + head * head_dim + j, table + j, half_dim,
              (is_q ? q_out_row : k_dst) + head * head_dim + j);
    } else {
      v_dst[i - rotations] = v_row[i - rotations];
    }
  }
}

// rope_write_kv for an FP8 cache (uint8 e4m3 bits): q as rope_write_kv_impl; k rotated, v as is, each
// quantized by kv_scale = (k_scale, v_scale) on the device. Same units and vector condition as the 16-bit
// kernel (an 8-element unit stores 8 bytes).
template <typename T, typename CacheT>
__device__ void rope_write_kv_fp8_impl(const T* q, const T* k, const T* v, const int* positions,
                                       const CacheT* cos_sin, const int* slot_mapping, const float* kv_scale,
                                       T* q_out, unsigned char* k_cache, unsigned char* v_cache,
                                       long long q_stride, long long k_stride, long long v_stride, int num_heads,
                                       int num_kv_heads, int head_dim) {
  const int token = blockIdx.x;
  const int half_dim = head_dim / 2;
  const int slot = slot_mapping[token];
  const int kv_heads = slot < 0 ? 0 : num_kv_heads;  // KV heads this token writes
  const Fp8Divisor k_scale = fp8_divisor(kv_scale[0]), v_scale = fp8_divisor(kv_scale[1]);
  const CacheT* table = cos_sin + (size_t)positions[token] * head_dim;
  const T* q_row = q + token * q_stride;
  const T* k_row = k + token * k_stride;
  const T* v_row = v + token * v_stride;
  T* q_out_row = q_out + (size_t)token * num_heads * head_dim;
  const size_t cache_row = (size_t)(slot < 0 ? 0 : slot) * num_kv_heads * head_dim;
  unsigned char* k_dst = k_cache + cache_row;
  unsigned char* v_dst = v_cache + cache_row;
  const bool vec = half_dim % VEC == 0 && q_stride % VEC == 0 && k_stride % VEC == 0 && v_stride % VEC == 0 &&
                   aligned16(q) && aligned16(k) && aligned16(v) && aligned16(cos_sin) && aligned16(q_out) &&
                   aligned16(k_cache) && aligned16(v_cache);
  if (vec) {  // units: q's 8-pair rotations, k's (quantized), then v's 8-element quantized copies
    const int units_per_head = half_dim / VEC;
    const int q_units = num_heads * units_per_head;
    const int rotations = q_units + kv_heads * units_per_head;
    const int units = rotations + kv_heads * head_dim / VEC;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      if (u < q_units) {
        const int head = u / units_per_head, j = (u - head * units_per_head) * VEC;
        rotate8(q_row + head * head_dim + j, table + j, half_dim, q_out_row + head * head_dim + j);
      } else if (u < rotations) {
        const int unit = u - q_units;
        const int head = unit / units_per_head, j = (unit - head * units_per_head) * VEC;
        float y1[VEC], y2[VEC];
        rotate8_values(k_row + head * head_dim + j, table + j, half_dim, y1, y2);
        store8_fp8<T>(k_dst + head * head_dim + j, y1, k_scale);
        store8_fp8<T>(k_dst + head * head_dim + j + half_dim, y2, k_scale);
      } else {
        const int at = (u - rotations) * VEC;
        float y[VEC];
        load8_float(v_row + at, y);
        store8_fp8<T>(v_dst + at, y, v_scale);
      }
    }
    return;
  }
  const int q_pairs = num_heads * half_dim;
  const int rotations = q_pairs + kv_heads * half_dim;
  for (int i = threadIdx.x; i < rotations + kv_heads * head_dim; i += blockDim.x) {
    if (i < q_pairs) {
      const int head = i / half_dim, j = i % half_dim;
      rotate1(q_row + head * head_dim + j, table + j, half_dim, q_out_row + head * head_dim + j);
    } else if (i < rotations) {
      const int pair = i - q_pairs;
      const int head = pair / half_dim, j = pair % half_dim;
      float y1, y2;
      rotate1_values(k_row + head * head_dim + j, table + j, half_dim, y1, y2);
      k_dst[head * head_dim + j] = (unsigned char)quantize1<T>(y1, k_scale);
      k_dst[head * head_dim + j + half_dim] = (unsigned char)quantize1<T>(y2, k_scale);
    } else {
      v_dst[i - rotations] = (unsigned char)quantize1<T>(to_float(v_row[i - rotations]), v_scale);
    }
  }
}

// 8 rotated or copied K/V values into a cache row: a 16-bit cache stores them rounded to T, an FP8 one as
// store8_fp8 (scale unused for 16-bit).
template <typename T>
__device__ __forceinline__ void store8_kv(T* p, const float (&y)[VEC], const Fp8Divisor&) { store8_float(p, y); }
template <typename T>
__device__ __forceinline__ void store8_kv(unsigned char* p, const float (&y)[VEC], const Fp8Divisor& scale) {
  store8_fp8<T>(p, y, scale);
}

// rope_write_kv reading q, k and v from the qkv projection's FP8 product before its scale epilogue: the token's
// row x (RowOfFp8Product) holds q in columns [0, H D), k in [H D, (H + Hkv) D), v after; each element is the
// epilogue's value (RowOfFp8Product), so every output is byte for byte scale_fp8_output then rope_write_kv(_fp8)
// of its q, k, v views. Vector path only (the launcher checks its condition): 8-pair units as rope_write_kv_impl.
// KvT: T (16-bit cache; kv_scale unused) or unsigned char (FP8 cache, kv_scale = (k_scale, v_scale)).
template <typename T, typename CacheT, typename KvT, typename X>
__device__ void rope_write_kv_product_impl(const X& x, const int* positions, const CacheT* cos_sin,
                                           const int* slot_mapping, const float* kv_scale, T* q_out, KvT* k_cache,
                                           KvT* v_cache, int num_heads, int num_kv_heads, int head_dim) {
  const int token = blockIdx.x;
  const int half_dim = head_dim / 2;
  const int slot = slot_mapping[token];
  const int kv_heads = slot < 0 ? 0 : num_kv_heads;  // KV heads this token writes
  const bool fp8 = sizeof(KvT) == 1;
  const Fp8Divisor k_scale = fp8_divisor(fp8 ? kv_scale[0] : 1.f);
  const Fp8Divisor v_scale = fp8_divisor(fp8 ? kv_scale[1] : 1.f);
  const CacheT* table = cos_sin + (size_t)positions[token] * head_dim;
  T* q_out_row = q_out + (size_t)token * num_heads * head_dim;
  const size_t cache_row = (size_t)(slot < 0 ? 0 : slot) * num_kv_heads * head_dim;
  KvT* k_dst = k_cache + cache_row;
  KvT* v_dst = v_cache + cache_row;
  const int k_col = num_heads * head_dim, v_col = k_col + num_kv_heads * head_dim;
  const int units_per_head = half_dim / VEC;
  const int q_units = num_heads * units_per_head;
  const int rotations = q_units + kv_heads * units_per_head;
  const int units = rotations + kv_heads * head_dim / VEC;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    if (u < rotations) {
      const bool is_q = u < q_units;
      const int unit = is_q ? u : u - q_units;
      const int head = unit / units_per_head, j = (unit - head * units_per_head) * VEC;
      const int col = (is_q ? 0 : k_col) + head * head_dim + j;
      float y1[VEC], y2[VEC];
      rotate8_pack(x.chunk(col), x.chunk(col + half_dim), table + j, half_dim, y1, y2);
      if (is_q) {
        store8_float(q_out_row + head * head_dim + j, y1);
        store8_float(q_out_row + head * head_dim + j + half_dim, y2);
      } else {
        store8_kv<T>(k_dst + head * head_dim + j, y1, k_scale);
        store8_kv<T>(k_dst + head * head_dim + j + half_dim, y2, k_scale);
      }
    } else {
      const int at = (u - rotations) * VEC;
      const Pack8<T> v = x.chunk(v_col + at);
      float y[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) y[i] = to_float(v.v[i]);
      store8_kv<T>(v_dst + at, y, v_scale);
    }
  }
}

// silu(gate) * up. The division is the hardware's approximate one (__fdividef, ~2 ulp; 2 instructions against
// IEEE division's ~12 and a branch), beside __expf's own approximation. For gate below about -87 it gives -0 where
// IEEE division gives -0 or a value under 1e-36. SILU_FAST_DIVISION 0: IEEE division (for A/B timings).
// e^-gate is __expf's: 2^(gate x -log2 e) on the hardware's ex2, here its flush-to-zero form, which skips __expf's
// fix-up of results under 2^-126 (three instructions a value); 1 + such a result is 1 either way, so no byte moves.
// SILU_EX2_FTZ 0: __expf (for A/B timings).
#ifndef SILU_FAST_DIVISION
#define SILU_FAST_DIVISION 1
#endif
#ifndef SILU_EX2_FTZ
#define SILU_EX2_FTZ 1
#endif
__device__ __forceinline__ float exp_of_minus(float gate) {
#if SILU_EX2_FTZ
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(gate * -1.44269504088896341f));
  return y;
#else
  return __expf(-gate);
#endif
}
__device__ __forceinline__ float silu_times(float gate, float up) {
#if SILU_FAST_DIVISION
  return __fdividef(gate, 1.f + exp_of_minus(gate)) * up;
#else
  return gate / (1.f + exp_of_minus(gate)) * up;
#endif
}

// silu(gate) * up of columns col..col+7 of a gate_up row (x: its source; up starts at column `inter`), each
// rounded to T.
template <typename T, typename X>
__device__ __forceinline__ Pack8<T> silu_mul8(const X& x, int inter, int col) {
  const Pack8<T> gate = x.chunk(col), up = x.chunk(inter + col);
  Pack8<T> y;
#pragma unroll
  for (int i = 0; i < VEC; ++i) y.v[i] = from_float<T>(silu_times(to_float(gate.v[i]), to_float(up.v[i])));
  return y;
}

// Rows: blockIdx.y strided by gridDim.y; columns (8-element chunks on the vector path, elements
// otherwise): blockIdx.x * blockDim.x + threadIdx.x strided by gridDim.x * blockDim.x.
template <typename T>
__device__ void silu_mul_impl(const T* gate_up, T* out, long long num_tokens, int inter) {
  const bool vec = inter % VEC == 0 && aligned16(gate_up) && aligned16(out);
  const int columns = vec ? inter / VEC : inter;
  for (long long t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const T* gate_row = gate_up + (size_t)t * 2 * inter;
    const T* up_row = gate_row + inter;
    T* out_row = out + (size_t)t * inter;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < columns; c += gridDim.x * blockDim.x) {
      if (vec) {
        store8(out_row + c * VEC, silu_mul8<T>(RowOf16<T>{gate_row}, inter, c * VEC));
      } else {
        out_row[c] = from_float<T>(silu_times(to_float(gate_row[c]), to_float(up_row[c])));
      }
    }
  }
}

// ---- The input of an FP8 linear made where its rows are made: rms_norm_fp8 and silu_mul_fp8 compute what
// rms_norm / silu_mul compute, rounded to T, then quantize each row as fp8_linear.cu's quantize_rows_fp8 does
// (amax over the rounded row, fp8_row_scale, e4m3 of value / scale), byte for byte that pair of launches.

// Largest |value| over the block, NaN kept (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// Once per block (its shared array is not reused).
__device__ __forceinline__ float block_amax(float value) {
  __shared__ float warp_max[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = nan_max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  if (lane == 0) warp_max[warp] = value;
  __syncthreads();
  value = lane < num_warps ? warp_max[lane] : 0.f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = nan_max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

template <typename T>
__device__ __forceinline__ float amax8(const Pack8<T>& y, float amax) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) amax = nan_max(amax, fabsf(to_float(y.v[i])));
  return amax;
}

// 8 values of T / scale as 8 e4m3 bytes at p (8-byte aligned).
template <typename T>
__device__ __forceinline__ void store8_e4m3(unsigned char* p, const Pack8<T>& y, const Fp8Divisor& scale) {
  float f[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) f[i] = scale(to_float(y.v[i]));
  *reinterpret_cast<uint2*>(p) = float8_to_e4m3x8(f);
}

// The block's row of xq: columns [width, padded_width) are zeros (they pad the GEMM's inner dimension).
__device__ __forceinline__ void zero_padding(unsigned char* q_row, int width, int padded_width) {
  for (int c = width + threadIdx.x; c < padded_width; c += blockDim.x) q_row[c] = 0;
}

// x: the block's row of the input (RowOf16 or RowOfFp8Product).
template <typename T, typename X>
__device__ void rms_norm_fp8_impl(const X& x, const T* residual, const T* weight, unsigned char* xq, float* x_scale,
                                  T* residual_out, int hidden, int padded_width, float eps, float static_scale) {
  const size_t row = (size_t)blockIdx.x * hidden;
  unsigned char* q_row = xq + (size_t)blockIdx.x * padded_width;
  const bool vec = hidden % VEC == 0 && x.aligned() && aligned16(residual) && aligned16(weight) &&
                   aligned16(residual_out) && aligned16(xq) && padded_width % 16 == 0;
  float amax = 0.f;
  if (vec) {
    const int chunks = hidden / VEC;
    Pack8<T> held[RMS_HELD];  // h, then the normed output
    const float inv_rms = rms_first_pass8(x, residual, residual_out, row, hidden, eps, held);
#pragma unroll
    for (int n = 0; n < RMS_HELD; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < chunks) {
        held[n] = rms_normed8(held[n], weight, c * VEC, inv_rms);
        amax = amax8(held[n], amax);
      }
    }
    for (int c = threadIdx.x + RMS_HELD * blockDim.x; c < chunks; c += blockDim.x) {
      amax = amax8(rms_normed8(load8(residual_out + row + (size_t)c * VEC), weight, c * VEC, inv_rms), amax);
    }
    const float row_scale = fp8_row_scale(block_amax(amax), static_scale);
    if (threadIdx.x == 0) x_scale[blockIdx.x] = row_scale;
    const Fp8Divisor scale = fp8_divisor(row_scale);
#pragma unroll
    for (int n = 0; n < RMS_HELD; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < chunks) store8_e4m3(q_row + c * VEC, held[n], scale);
    }
    for (int c = threadIdx.x + RMS_HELD * blockDim.x; c < chunks; c += blockDim.x) {
      const Pack8<T> h = load8(residual_out + row + (size_t)c * VEC);
      store8_e4m3(q_row + c * VEC, rms_normed8(h, weight, c * VEC, inv_rms), scale);
    }
  } else {
    const float inv_rms = rms_first_pass1(x, residual, residual_out, row, hidden, eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
      amax = nan_max(amax, fabsf(rms_normed1(residual_out[row + i], weight[i], inv_rms)));
    const float row_scale = fp8_row_scale(block_amax(amax), static_scale);
    if (threadIdx.x == 0) x_scale[blockIdx.x] = row_scale;
    const Fp8Divisor scale = fp8_divisor(row_scale);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
      q_row[i] = (unsigned char)float_to_e4m3(scale(rms_normed1(residual_out[row + i], weight[i], inv_rms)));
  }
  zero_padding(q_row, hidden, padded_width);
}

// silu_mul's output chunks a thread keeps in registers between its amax and its quantize pass (later ones are
// computed twice).
constexpr int SILU_HELD = 4;

// x: the block's gate_up row (RowOf16 or RowOfFp8Product).
template <typename T, typename X>
__device__ void silu_mul_fp8_impl(const X& x, unsigned char* xq, float* x_scale, int inter, int padded_width,
                                  float static_scale) {
  unsigned char* q_row = xq + (size_t)blockIdx.x * padded_width;
  const bool vec = inter % VEC == 0 && x.aligned() && aligned16(xq) && padded_width % 16 == 0;
  float amax = 0.f;
  if (vec) {
    const int chunks = inter / VEC;
    Pack8<T> held[SILU_HELD];
#pragma unroll
    for (int n = 0; n < SILU_HELD; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < chunks) {
        held[n] = silu_mul8<T>(x, inter, c * VEC);
        amax = amax8(held[n], amax);
      }
    }
    for (int c = threadIdx.x + SILU_HELD * blockDim.x; c < chunks; c += blockDim.x)
      amax = amax8(silu_mul8<T>(x, inter, c * VEC), amax);
    const float row_scale = fp8_row_scale(block_amax(amax), static_scale);
    if (threadIdx.x == 0) x_scale[blockIdx.x] = row_scale;
    const Fp8Divisor scale = fp8_divisor(row_scale);
#pragma unroll
    for (int n = 0; n < SILU_HELD; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < chunks) store8_e4m3(q_row + c * VEC, held[n], scale);
    }
    for (int c = threadIdx.x + SILU_HELD * blockDim.x; c < chunks; c += blockDim.x)
      store8_e4m3(q_row + c * VEC, silu_mul8<T>(x, inter, c * VEC), scale);
  } else {
    for (int i = threadIdx.x; i < inter; i += blockDim.x)
      amax = nan_max(amax, fabsf(to_float(from_float<T>(silu_times(to_float(x.one(i)), to_float(x.one(inter + i)))))));
    const float row_scale = fp8_row_scale(block_amax(amax), static_scale);
    if (threadIdx.x == 0) x_scale[blockIdx.x] = row_scale;
    const Fp8Divisor scale = fp8_divisor(row_scale);
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
      const float y = to_float(from_float<T>(silu_times(to_float(x.one(i)), to_float(x.one(inter + i)))));
      q_row[i] = (unsigned char)float_to_e4m3(scale(y));
    }
  }
  zero_padding(q_row, inter, padded_width);
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
  extern "C" __global__ void __launch_bounds__(1024)                                                        \
      rms_norm_##SUFFIX(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int hidden, \
                        float eps) {                                                                         \
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
  extern "C" __global__ void rope_write_kv_same_cache_##SUFFIX(                                             \
      const T* q, const T* k, const T* v, const int* positions, const T* cos_sin, const int* slot_mapping,    \
      T* q_out, T* k_cache, T* v_cache, long long q_stride, long long k_stride, long long v_stride,           \
      int num_heads, int num_kv_heads, int head_dim) {                                                        \
    rope_write_kv_impl<T, T>(q, k, v, positions, cos_sin, slot_mapping, q_out, k_cache, v_cache, q_stride,    \
                             k_stride, v_stride, num_heads, num_kv_heads, head_dim);                          \
  }                                                                                                           \
  extern "C" __global__ void rope_write_kv_f32_cache_##SUFFIX(                                              \
      const T* q, const T* k, const T* v, const int* positions, const float* cos_sin, const int* slot_mapping, \
      T* q_out, T* k_cache, T* v_cache, long long q_stride, long long k_stride, long long v_stride,           \
      int num_heads, int num_kv_heads, int head_dim) {                                                        \
    rope_write_kv_impl<T, float>(q, k, v, positions, cos_sin, slot_mapping, q_out, k_cache, v_cache, q_stride, \
                                 k_stride, v_stride, num_heads, num_kv_heads, head_dim);                      \
  }                                                                                                           \
  extern "C" __global__ void rope_write_kv_fp8_same_cache_##SUFFIX(                                         \
      const T* q, const T* k, const T* v, const int* positions, const T* cos_sin, const int* slot_mapping,    \
      const float* kv_scale, T* q_out, unsigned char* k_cache, unsigned char* v_cache, long long q_stride,    \
      long long k_stride, long long v_stride, int num_heads, int num_kv_heads, int head_dim) {                \
    rope_write_kv_fp8_impl<T, T>(q, k, v, positions, cos_sin, slot_mapping, kv_scale, q_out, k_cache,         \
                                 v_cache, q_stride, k_stride, v_stride, num_heads, num_kv_heads, head_dim);   \
  }                                                                                                           \
  extern "C" __global__ void rope_write_kv_fp8_f32_cache_##SUFFIX(                                          \
      const T* q, const T* k, const T* v, const int* positions, const float* cos_sin, const int* slot_mapping, \
      const float* kv_scale, T* q_out, unsigned char* k_cache, unsigned char* v_cache, long long q_stride,    \
      long long k_stride, long long v_stride, int num_heads, int num_kv_heads, int head_dim) {                \
    rope_write_kv_fp8_impl<T, float>(q, k, v, positions, cos_sin, slot_mapping, kv_scale, q_out, k_cache,     \
                                     v_cache, q_stride, k_stride, v_stride, num_heads, num_kv_heads,          \
                                     head_dim);                                                               \
  }                                                                                                           \
  extern "C" __global__ void head_rms_norm_##SUFFIX(const T* q, const T* k, const T* q_weight, const T* k_weight,   \
                                                     T* q_out, T* k_out, long long q_stride, long long k_stride, \
                                                     int num_heads, int num_kv_heads, int head_dim, float eps) { \
    head_rms_norm_impl<T>(q, k, q_weight, k_weight, q_out, k_out, q_stride, k_stride, num_heads, num_kv_heads,   \
                          head_dim, eps);                                                                       \
  }                                                                                                             \
  extern "C" __global__ void silu_mul_##SUFFIX(const T* gate_up, T* out, long long num_tokens, int inter) { \
    silu_mul_impl<T>(gate_up, out, num_tokens, inter);                                                      \
  }                                                                                                         \
  extern "C" __global__ void add_bias_##SUFFIX(T* x, const T* bias, long long total, int width) {           \
    add_bias_impl<T>(x, bias, total, width);                                                                \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(1024)                                                        \
      rms_norm_fp8_##SUFFIX(const T* x, const T* residual, const T* weight, unsigned char* xq, float* x_scale, \
                            T* residual_out, int hidden, int padded_width, float eps, float static_scale) {  \
    rms_norm_fp8_impl<T>(RowOf16<T>{x + (size_t)blockIdx.x * hidden}, residual, weight, xq, x_scale,         \
                         residual_out, hidden, padded_width, eps, static_scale);                            \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(1024)                                                        \
      silu_mul_fp8_##SUFFIX(const T* gate_up, unsigned char* xq, float* x_scale, int inter, int padded_width, \
                            float static_scale) {                                                           \
    silu_mul_fp8_impl<T>(RowOf16<T>{gate_up + (size_t)blockIdx.x * 2 * inter}, xq, x_scale, inter,           \
                         padded_width, static_scale);                                                       \
  }

// The product-reading forms of rms_norm_fp8 and silu_mul_fp8, for an accumulator of A (TAG: nothing for float32,
// _bf16acc for bfloat16).
#define DEFINE_PRODUCT_KERNELS(T, SUFFIX, A, TAG)                                                              \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm_fp8_product##TAG##_##SUFFIX(                     \
      const A* acc, const float* acc_x_scale, const float* acc_w_scale, int acc_width, const T* residual,     \
      const T* weight, unsigned char* xq, float* x_scale, T* residual_out, int hidden, int padded_width,      \
      float eps, float static_scale) {                                                                        \
    const RowOfFp8Product<T, A> x{acc + (size_t)blockIdx.x * acc_width, acc_x_scale[blockIdx.x], acc_w_scale}; \
    rms_norm_fp8_impl<T>(x, residual, weight, xq, x_scale, residual_out, hidden, padded_width, eps,            \
                         static_scale);                                                                       \
  }                                                                                                           \
  extern "C" __global__ void rope_write_kv_product##TAG##_##SUFFIX(                                            \
      const A* acc, const float* acc_x_scale, const float* acc_w_scale, int acc_width, const int* positions,  \
      const T* cos_sin, const int* slot_mapping, T* q_out, T* k_cache, T* v_cache, int num_heads,             \
      int num_kv_heads, int head_dim) {                                                                       \
    const RowOfFp8Product<T, A> x{acc + (size_t)blockIdx.x * acc_width, acc_x_scale[blockIdx.x], acc_w_scale}; \
    rope_write_kv_product_impl<T, T, T>(x, positions, cos_sin, slot_mapping, nullptr, q_out, k_cache,        \
                                            v_cache, num_heads, num_kv_heads, head_dim);                      \
  }                                                                                                           \
  extern "C" __global__ void rope_write_kv_fp8_product##TAG##_##SUFFIX(                                        \
      const A* acc, const float* acc_x_scale, const float* acc_w_scale, int acc_width, const int* positions,  \
      const T* cos_sin, const int* slot_mapping, const float* kv_scale, T* q_out, unsigned char* k_cache,      \
      unsigned char* v_cache, int num_heads, int num_kv_heads, int head_dim) {                                \
    const RowOfFp8Product<T, A> x{acc + (size_t)blockIdx.x * acc_width, acc_x_scale[blockIdx.x], acc_w_scale}; \
    rope_write_kv_product_impl<T, T, unsigned char>(x, positions, cos_sin, slot_mapping, kv_scale, q_out,     \
                                                        k_cache, v_cache, num_heads, num_kv_heads, head_dim); \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(1024) silu_mul_fp8_product##TAG##_##SUFFIX(                    \
      const A* acc, const float* acc_x_scale, const float* acc_w_scale, int acc_width, unsigned char* xq,     \
      float* x_scale, int inter, int padded_width, float static_scale) {                                      \
    const RowOfFp8Product<T, A> x{acc + (size_t)blockIdx.x * acc_width, acc_x_scale[blockIdx.x], acc_w_scale}; \
    silu_mul_fp8_impl<T>(x, xq, x_scale, inter, padded_width, static_scale);                                  \
  }
DEFINE_LAYER_KERNELS(__half, f16)
DEFINE_LAYER_KERNELS(bf16_t, bf16)
DEFINE_PRODUCT_KERNELS(__half, f16, float, )
DEFINE_PRODUCT_KERNELS(bf16_t, bf16, float, )
DEFINE_PRODUCT_KERNELS(__half, f16, bf16_t, _bf16acc)
DEFINE_PRODUCT_KERNELS(bf16_t, bf16, bf16_t, _bf16acc)
