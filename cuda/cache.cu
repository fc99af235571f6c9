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
