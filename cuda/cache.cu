// KV-cache maintenance: writing new K/V rows by slot, and copy-on-write block copies across all layers.
// Both only move bytes, so one kernel serves every 2-byte element type (fp16 and bf16): `elem16` below.
//
// write_kv
//   k, v         [T, Hkv, D] fp16 or bf16; row t starts at k + t * k_row_stride (elements; a view into the fused
//                qkv projection is fine), the [Hkv, D] part is contiguous; 16-byte aligned rows
//   k_cache, v_cache [N, B, Hkv, D] same type, contiguous; slot s = block * B + offset is row s of [N*B, Hkv, D]
//   slot_mapping [T] int32; a negative slot means "padding, skip"
//   Grid: x = token (T CTAs); block: 128 threads striding over the row's Hkv*D/8 16-byte vectors.
//   (The model's forward writes K/V with layer.cu's rope_write_kv, which rotates k on the way; this one is
//   the plain copy.)
//
// copy_blocks
//   kv_cache     [L, 2, N, E] fp16 or bf16 contiguous, E = B * Hkv * D elements per block (a multiple of 8)
//   src_ids, dst_ids [P] int32: block dst <- block src in every layer, K and V
//   Grid: x = pair, y = layer * 2 + (0 K | 1 V); block: 128 threads striding over E/8 16-byte vectors.
//   The launcher guarantees no dst is also a src, so the order of the copies does not matter.
//   An FP8 pool (uint8) is copied as 2-byte units too: the launcher views it as uint16 (E halves).
//
// write_kv_fp8_{f16,bf16} (the FP8 KV cache; cuda/fp8.cuh)
//   k, v         [T, Hkv, D] fp16 or bf16 as in write_kv
//   k_cache, v_cache [N, B, Hkv, D] uint8 (e4m3fn bits), contiguous; row s = slot s
//   kv_scale     [2] fp32 on the device: (k_scale, v_scale); stored = e4m3(x / scale), ties to even,
//                saturated to +-448: byte for byte the NumPy reference's quantize_fp8
//   Grid: x = token; block: threads striding over the row's Hkv*D/8 8-element units (16 bytes in, 8 out).
#include <cuda_fp16.h>
#include "fp8.cuh"

typedef unsigned short elem16;  // the bits of one fp16 or bf16 element

extern "C" __global__ void write_kv(const elem16* k, const elem16* v, elem16* k_cache, elem16* v_cache,
                                    const int* slot_mapping, long long k_row_stride, long long v_row_stride,
                                    int row_elems) {
  const int token = blockIdx.x;
  const int slot = slot_mapping[token];
  if (slot < 0) return;
  const uint4* k_src = reinterpret_cast<const uint4*>(k + token * k_row_stride);
  const uint4* v_src = reinterpret_cast<const uint4*>(v + token * v_row_stride);
  uint4* k_dst = reinterpret_cast<uint4*>(k_cache + (size_t)slot * row_elems);
  uint4* v_dst = reinterpret_cast<uint4*>(v_cache + (size_t)slot * row_elems);
  for (int i = threadIdx.x; i < row_elems / 8; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

extern "C" __global__ void copy_blocks(elem16* kv_cache, const int* src_ids, const int* dst_ids,
                                       long long num_blocks, int block_elems) {
  const int pair = blockIdx.x;
  const size_t plane = (size_t)blockIdx.y * num_blocks * block_elems;  // start of kv_cache[l, kind]
  const uint4* src = reinterpret_cast<const uint4*>(kv_cache + plane + (size_t)src_ids[pair] * block_elems);
  uint4* dst = reinterpret_cast<uint4*>(kv_cache + plane + (size_t)dst_ids[pair] * block_elems);
  for (int i = threadIdx.x; i < block_elems / 8; i += blockDim.x) dst[i] = src[i];
}

namespace {

__device__ __forceinline__ float elem_to_float(unsigned short bits, bool bf16) {
  return bf16 ? __uint_as_float((unsigned)bits << 16) : __half2float(__ushort_as_half(bits));
}

// Eight fp16/bf16 elements (a 16-byte vector) divided by `scale`, quantized to eight e4m3 bytes.
template <bool BF16>
__device__ __forceinline__ uint2 quantize8(const uint4& in, const Fp8Divisor& scale) {
  const unsigned words[4] = {in.x, in.y, in.z, in.w};
  float f[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = scale(elem_to_float((unsigned short)(words[i / 2] >> (16 * (i % 2))), BF16));
  return float8_to_e4m3x8(f);
}

template <bool BF16>
__device__ void write_kv_fp8_impl(const elem16* k, const elem16* v, unsigned char* k_cache,
                                  unsigned char* v_cache, const int* slot_mapping, const float* kv_scale,
                                  long long k_row_stride, long long v_row_stride, int row_elems) {
  const int token = blockIdx.x;
  const int slot = slot_mapping[token];
  if (slot < 0) return;
  const Fp8Divisor k_scale = fp8_divisor(kv_scale[0]), v_scale = fp8_divisor(kv_scale[1]);
  const uint4* k_src = reinterpret_cast<const uint4*>(k + token * k_row_stride);
  const uint4* v_src = reinterpret_cast<const uint4*>(v + token * v_row_stride);
  uint2* k_dst = reinterpret_cast<uint2*>(k_cache + (size_t)slot * row_elems);
  uint2* v_dst = reinterpret_cast<uint2*>(v_cache + (size_t)slot * row_elems);
  for (int i = threadIdx.x; i < row_elems / 8; i += blockDim.x) {
    k_dst[i] = quantize8<BF16>(k_src[i], k_scale);
    v_dst[i] = quantize8<BF16>(v_src[i], v_scale);
  }
}

}  // namespace

#define DEFINE_WRITE_KV_FP8(BF16, SUFFIX)                                                                    \
  extern "C" __global__ void write_kv_fp8_##SUFFIX(const elem16* k, const elem16* v, unsigned char* k_cache, \
                                                   unsigned char* v_cache, const int* slot_mapping,          \
                                                   const float* kv_scale, long long k_row_stride,            \
                                                   long long v_row_stride, int row_elems) {                  \
    write_kv_fp8_impl<BF16>(k, v, k_cache, v_cache, slot_mapping, kv_scale, k_row_stride, v_row_stride,      \
                            row_elems);                                                                      \
  }
DEFINE_WRITE_KV_FP8(false, f16)
DEFINE_WRITE_KV_FP8(true, bf16)
