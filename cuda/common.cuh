// Device helpers shared by attention.cu and prefill_attention.cu (included by both, after fp8.cuh;
// kernel_modules.py inlines `#include "common.cuh"` for NVRTC, nvcc finds it beside them). No buffers, no kernels.
#include <cuda_fp16.h>

// A bfloat16 as its 16 bits. NVRTC may not find a cuda_bf16.h matching the cuda_fp16.h CuPy bundles, so
// the few conversions needed are PTX instructions of sm_80+ (what mma.sync needs anyway).
struct __align__(2) bf16_t {
  unsigned short bits;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Two floats rounded to T (round to nearest even), packed (lo in the low 16 bits).
template <typename T>
__device__ __forceinline__ unsigned pack_float2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned pack_float2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

template <>
__device__ __forceinline__ unsigned pack_float2<bf16_t>(float lo, float hi) {
  unsigned packed;  // cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// Eight e4m3 cache elements (cuda/fp8.cuh, which the including file includes first) as eight T in a
// 16-byte vector, element i in half i; exact for both types (e4m3 values fit fp16 and bf16).
template <typename T>
__device__ __forceinline__ uint4 e4m3x8_to(uint2 w);

template <>
__device__ __forceinline__ uint4 e4m3x8_to<__half>(uint2 w) {
  return e4m3x8_to_half8(w);
}

template <>
__device__ __forceinline__ uint4 e4m3x8_to<bf16_t>(uint2 w) {
  return e4m3x8_to_bf16x8(w);
}

// cp.async completion is tracked in groups: commit after each stage, wait until <= N are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
