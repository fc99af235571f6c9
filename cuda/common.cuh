// Device helpers shared by attention.cu and prefill_attention.cu (included by both; kernel_modules.py
// inlines `#include "common.cuh"` for NVRTC, nvcc finds it beside them). No buffers, no kernels.
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

// cp.async completion is tracked in groups: commit after each stage, wait until <= N are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
