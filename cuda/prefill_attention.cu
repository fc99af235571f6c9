// Paged causal grouped-query attention for long query chunks (prefill, chunked prefill, mixed batches
// whose longest query fills a tile), FlashAttention-2 style, on tensor cores (mma.sync m16n8k16).
//
// Element type T: fp16 (__half, names ending _f16) or bf16 (bf16_t, _bf16: the bits of a bfloat16,
// converted with PTX cvt so that no cuda_bf16.h is needed under NVRTC). Products accumulate in fp32.
//
// Buffers (all contiguous, T unless said) and the argument list are those of attention.cu's kernels, so
// that launchers.paged_attention launches either with the same arguments:
//   q            [T, H, D]        query rows; sequence s owns rows query_start_loc[s] .. query_start_loc[s+1]-1
//   k_cache      [N, B, Hkv, D]   key pool of one layer; token p of sequence s is at
//   v_cache      [N, B, Hkv, D]   block block_tables[s, p / B], offset p % B (any B >= 1)
//   out          [T, H, D]        written for every row that belongs to a sequence (num_splits == 1)
//   block_tables [S, M] int32, context_lens [S] int32 (tokens cached, this step's included),
//   query_start_loc [S + 1] int32, launch_order [S] int32 or null
//   partial_o    [num_splits, T, H, D] fp32   un-normalised partial outputs (only when num_splits > 1;
//   partial_ml   [num_splits, T, H, 2] fp32   then attention.cu's merge_partials combines them)
//   window       sliding window (0 = none): a query at position p sees keys p - window < k <= p
//
// Rows. For one (sequence, kv head) the G = H / Hkv query heads and the q_len query tokens form
// q_len * G rows (row f = token f / G, head kvh * G + f % G), so the G heads of a group share every K/V
// load. A CTA owns a tile of 128 rows (8 warps x 16 rows, the mma M) and walks its keys in tiles of
// 64: S = Q K^T (Q in registers, K by ldmatrix), one online-softmax rescale per 64 keys in log2 units
// (exp2 with the scale folded into one FMA), O += P V (P from S's accumulators, V by ldmatrix.trans).
// Key tiles wholly above every row's causal diagonal (or wholly before every row's window) are never
// loaded; a warp skips tiles none of its rows sees and masks only tiles that cross a diagonal or a
// window edge.
//
// Shared memory (dynamic, STAGES x 2 x 64 x D x 2 bytes): stage s holds K then V of one key tile, each
// [64 keys][D / 8 pieces of 16 bytes]; piece c of key k sits at c ^ (k % 8), so the 8 row addresses of
// each ldmatrix 8x8 matrix (8 keys, one piece) fall in 8 distinct bank groups. K/V tiles arrive by
// cp.async (16 bytes a copy, zero-filled outside the CTA's key range: no slot past a context or
// before a window is read), PREFILL_STAGES - 1 tiles in flight while the warps compute on one (2 stages:
// double-buffered), and each thread reads its block-table entries a tile earlier still, so no copy waits
// on the table. One __syncthreads per tile both publishes the landed tile and frees the stage refilled next.
//
// Grid: x = kv_head * num_splits + split, y = row tile counted from the last (the tiles with the most
// keys launch first; x varies fastest, so all kv heads of a heavy tile go before the lighter tiles),
// z = sequence (launch_order[z] when given). Block: 256 threads = 8 warps. A split is a range of
// partition_size keys (a multiple of 64) counted from the window start of the tile's first row
// rounded down to 64, as in attention.cu.
// fp8.cuh before common.cuh, which uses it
#include "fp8.cuh"
#include "common.cuh"

namespace {

constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int WARP_ROWS = 16;               // rows per warp (mma M)
constexpr int TILE_ROWS = WARPS * WARP_ROWS;  // rows per CTA
constexpr int TILE_KEYS = 64;               // keys per K/V tile (one softmax rescale each)
constexpr int PREFILL_STAGES = 3;           // cp.async stages (launchers.py keeps a copy: it sizes shared memory)


template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<bf16_t>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned long long address;
  asm("cvta.to.shared.u64 %0, %1;\n" : "=l"(address) : "l"(p));
  return static_cast<unsigned>(address);
}

// 2^x by the SFU (about 2 ulp; 2^-inf = 0): the softmax's exponent, its scale folded into x.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16 bytes global -> shared (sm_80+); ok = false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned smem, const void* gmem, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(ok ? 16 : 0));
}

// Four 8x8 matrices of 16-bit elements; lanes 8i .. 8i + 7 give the row addresses of matrix i. Plain:
// lane (g, t) gets row g, columns 2t, 2t + 1 of each; .trans: column g, rows 2t, 2t + 1.
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T, typename C = T>  // C: the cache element, T or fp8_e4m3_t
struct Params {
  const T* q;
  const C* k_cache;
  const C* v_cache;
  T* out;
  float* partial_o;
  float* partial_ml;
  const int* block_tables;
  const int* context_lens;
  const int* query_start_loc;
  const int* launch_order;
  int num_tokens;
  int num_kv_heads;
  int group;
  int block_size;
  int max_blocks_per_seq;
  int partition_size;
  int num_splits;
  float scale_log2;  // softmax scale * log2(e)
  int block_shift;   // log2(block_size) when it is a power of two, else -1
  int window;        // 0 = none
  float v_scale;     // FP8 cache: the V scale, applied to O (the K scale is folded into scale_log2)
};

// A thread's share of a K/V tile: the keys threadIdx.x / PIECES + (THREADS / PIECES) j, piece
// threadIdx.x % PIECES of each (16 threads per key at D = 128: a key's D elements are contiguous).
template <int D>
constexpr int KEYS_PER_THREAD = TILE_KEYS * (D / 8) / THREADS;

// The cache slots of this thread's keys of tile k0, or -1 for keys outside [range_lo, range_end) (those
// are zero-filled and their table entries never read). Fetched a tile ahead, so that no cp.async waits
// for a block-table read.
template <int D, typename T, typename C>
__device__ __forceinline__ void tile_slots(const Params<T, C>& P, const int* table, int k0, int range_lo, int range_end,
                                           int (&slots)[KEYS_PER_THREAD<D>]) {
  constexpr int PIECES = D / 8;
#pragma unroll
  for (int j = 0; j < KEYS_PER_THREAD<D>; ++j) {
    const int p = k0 + threadIdx.x / PIECES + (THREADS / PIECES) * j;
    if (p < range_lo || p >= range_end) {
      slots[j] = -1;
    } else if (P.block_shift >= 0) {
      slots[j] = (table[p >> P.block_shift] << P.block_shift) + (p & ((1 << P.block_shift) - 1));
    } else {
      slots[j] = table[p / P.block_size] * P.block_size + p % P.block_size;
    }
  }
}

// Request a tile's K and V (cp.async, not waited for) into the stage at shared address `stage`.
template <int D, typename T, typename C>
__device__ __forceinline__ void copy_tile(const Params<T, C>& P, int kvh, const int (&slots)[KEYS_PER_THREAD<D>],
                                          unsigned stage) {
  constexpr int PIECES = D / 8;
  constexpr int TILE_BYTES = TILE_KEYS * PIECES * 16;
  const int piece = threadIdx.x % PIECES;
#pragma unroll
  for (int j = 0; j < KEYS_PER_THREAD<D>; ++j) {
    const int key = threadIdx.x / PIECES + (THREADS / PIECES) * j;
    const bool ok = slots[j] >= 0;
    const size_t offset = ok ? ((size_t)slots[j] * P.num_kv_heads + kvh) * D + 8 * piece : 0;
    const unsigned at = stage + (key * PIECES + (piece ^ (key & 7))) * 16;
    cp_async16(at, P.k_cache + offset, ok);
    cp_async16(at + TILE_BYTES, P.v_cache + offset, ok);
  }
}

// FP8 cache: a tile goes through registers instead of cp.async. load_tile_fp8 requests this thread's 8-byte
// pieces (the same keys and pieces as copy_tile; zeros outside the range) and store_tile_fp8 later writes
// them converted to T into the stage, in copy_tile's 16-bit layout, so attend_tile's ldmatrix reads are
// unchanged. prefill_impl issues the loads before a tile's arithmetic and stores after it, so the load
// latency hides behind the arithmetic as the cp.async copies do.
template <int D, typename T, typename C>
__device__ __forceinline__ void load_tile_fp8(const Params<T, C>& P, int kvh, const int (&slots)[KEYS_PER_THREAD<D>],
                                              uint2 (&k_raw)[KEYS_PER_THREAD<D>], uint2 (&v_raw)[KEYS_PER_THREAD<D>]) {
  constexpr int PIECES = D / 8;
  const int piece = threadIdx.x % PIECES;
#pragma unroll
  for (int j = 0; j < KEYS_PER_THREAD<D>; ++j) {
    const bool ok = slots[j] >= 0;
    const size_t offset = ok ? ((size_t)slots[j] * P.num_kv_heads + kvh) * D + 8 * piece : 0;
    k_raw[j] = ok ? *reinterpret_cast<const uint2*>(P.k_cache + offset) : make_uint2(0u, 0u);
    v_raw[j] = ok ? *reinterpret_cast<const uint2*>(P.v_cache + offset) : make_uint2(0u, 0u);
  }
}

__device__ __forceinline__ void store_shared16(unsigned addr, const uint4& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

template <int D, typename T>
__device__ __forceinline__ void store_tile_fp8(const uint2 (&k_raw)[KEYS_PER_THREAD<D>],
                                               const uint2 (&v_raw)[KEYS_PER_THREAD<D>], unsigned stage) {
  constexpr int PIECES = D / 8;
  constexpr int TILE_BYTES = TILE_KEYS * PIECES * 16;
  const int piece = threadIdx.x % PIECES;
#pragma unroll
  for (int j = 0; j < KEYS_PER_THREAD<D>; ++j) {
    const int key = threadIdx.x / PIECES + (THREADS / PIECES) * j;
    const unsigned at = stage + (key * PIECES + (piece ^ (key & 7))) * 16;
    store_shared16(at, e4m3x8_to<T>(k_raw[j]));
    store_shared16(at + TILE_BYTES, e4m3x8_to<T>(v_raw[j]));
  }
}

// Online-softmax state of one warp's 16 rows (row g: "lo", row g + 8: "hi" of lane (g, t)).
template <int D>
struct WarpState {
  float o[D / 8][4];  // O accumulators: n8 tile j holds d = 8j + 2t, 8j + 2t + 1
  float m_lo, m_hi;   // running max, log2 units (scaled)
  float l_lo, l_hi;   // this lane's part of the running sum
};

// One 64-key tile for a warp's 16 rows; K/V in the stage at k_stage / k_stage + tile bytes.
template <int D, typename T, typename C>
__device__ __forceinline__ void attend_tile(const Params<T, C>& P, const unsigned (&qa)[D / 16][4], unsigned k_stage,
                                            int lane, int k0, bool masked, int pos_lo, int pos_hi, int window,
                                            WarpState<D>& st) {
  constexpr int PIECES = D / 8;
  const unsigned v_stage = k_stage + TILE_KEYS * PIECES * 16;
  const int t = lane & 3, r = lane & 7, mat = lane >> 3;  // ldmatrix: this lane's matrix and row in it
  float s[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
  // S = Q K^T. ldmatrix matrices: 0 / 1 keys 16np + r, pieces 2kk / 2kk + 1 (b0, b1 of n tile 2np);
  // 2 / 3 the same for keys 16np + 8 + r (n tile 2np + 1).
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      const int key = 16 * np + 8 * (mat >> 1) + r;
      const int piece = (2 * kk + (mat & 1)) ^ r;  // key % 8 == r
      unsigned b0, b1, b2, b3;
      ldmatrix_x4(k_stage + (key * PIECES + piece) * 16, b0, b1, b2, b3);
      mma16816<T>(s[2 * np], qa[kk], b0, b1);
      mma16816<T>(s[2 * np + 1], qa[kk], b2, b3);
    }
  }
  if (masked) {  // causal and window: key p is seen by the row at position pos iff pos - window < p <= pos
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int p = k0 + 8 * n + 2 * t + (e & 1);
        const int pos = e < 2 ? pos_lo : pos_hi;
        if (p > pos || p <= pos - window) s[n][e] = neg_inf();
      }
  }
  float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
  }
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
  const float new_lo = fmaxf(st.m_lo, mx_lo * P.scale_log2), new_hi = fmaxf(st.m_hi, mx_hi * P.scale_log2);
  // A row that has seen only masked keys keeps max -inf; subtract 0 then, so no (-inf) - (-inf) = NaN.
  const float base_lo = new_lo == neg_inf() ? 0.f : new_lo;
  const float base_hi = new_hi == neg_inf() ? 0.f : new_hi;
  const float alpha_lo = fast_exp2(st.m_lo - base_lo), alpha_hi = fast_exp2(st.m_hi - base_hi);
  st.m_lo = new_lo;
  st.m_hi = new_hi;
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    s[n][0] = fast_exp2(fmaf(s[n][0], P.scale_log2, -base_lo));
    s[n][1] = fast_exp2(fmaf(s[n][1], P.scale_log2, -base_lo));
    s[n][2] = fast_exp2(fmaf(s[n][2], P.scale_log2, -base_hi));
    s[n][3] = fast_exp2(fmaf(s[n][3], P.scale_log2, -base_hi));
    sum_lo += s[n][0] + s[n][1];
    sum_hi += s[n][2] + s[n][3];
  }
  st.l_lo = st.l_lo * alpha_lo + sum_lo;
  st.l_hi = st.l_hi * alpha_hi + sum_hi;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    st.o[j][0] *= alpha_lo; st.o[j][1] *= alpha_lo; st.o[j][2] *= alpha_hi; st.o[j][3] *= alpha_hi;
  }
  // O += P V, 16 keys per k step: S's n tiles 2ks, 2ks + 1 are exactly P's A fragment. ldmatrix.trans
  // matrices: 0 / 1 keys 16ks + r / 16ks + 8 + r at piece 2mp (b0, b1 of d tile 2mp); 2 / 3 at piece 2mp + 1.
  unsigned pa[4][4];  // packed before the products, so S's 32 floats are dead during them
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    pa[ks][0] = pack_float2<T>(s[2 * ks][0], s[2 * ks][1]);
    pa[ks][1] = pack_float2<T>(s[2 * ks][2], s[2 * ks][3]);
    pa[ks][2] = pack_float2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    pa[ks][3] = pack_float2<T>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const int key = 16 * ks + 8 * (mat & 1) + r;
#pragma unroll
    for (int mp = 0; mp < D / 16; ++mp) {
      const int piece = (2 * mp + (mat >> 1)) ^ r;
      unsigned b0, b1, b2, b3;
      ldmatrix_x4_trans(v_stage + (key * PIECES + piece) * 16, b0, b1, b2, b3);
      mma16816<T>(st.o[2 * mp], pa[ks], b0, b1);
      mma16816<T>(st.o[2 * mp + 1], pa[ks], b2, b3);
    }
  }
}

// Write one row's result: normalised T with one split, else un-normalised fp32 partials and (max, sum).
template <int D, typename T, typename C>
__device__ __forceinline__ void write_row(const Params<T, C>& P, size_t th, int split, int t, const float (&o)[D / 8][4],
                                          int half, float m, float l) {
  const float vs = kIsFp8<C> ? P.v_scale : 1.f;  // (FP8: O = sum p (stored V) x v_scale)
  if (P.num_splits == 1) {
    float inv = l > 0.f ? 1.f / l : 0.f;
    if constexpr (kIsFp8<C>) inv *= vs;
    unsigned* dst = reinterpret_cast<unsigned*>(P.out + th * D);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) dst[4 * j + t] = pack_float2<T>(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
  } else {
    const size_t row = (size_t)split * P.num_tokens * (P.num_kv_heads * P.group) + th;
    float2* dst = reinterpret_cast<float2*>(P.partial_o + row * D);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      if constexpr (kIsFp8<C>) {
        dst[4 * j + t] = make_float2(o[j][2 * half] * vs, o[j][2 * half + 1] * vs);
      } else {
        dst[4 * j + t] = make_float2(o[j][2 * half], o[j][2 * half + 1]);
      }
    }
    if (t == 0) {
      P.partial_ml[row * 2] = m;
      P.partial_ml[row * 2 + 1] = l;
    }
  }
}

template <int D, typename T, typename C>
__device__ void prefill_impl(const Params<T, C>& P) {
  static_assert(D == 64 || D == 128, "head dim must be 64 or 128");
  static_assert(PREFILL_STAGES >= 2, "one stage in use while the next tiles are copied");
  constexpr int STAGE_BYTES = 2 * TILE_KEYS * D * 2;  // K and V of one tile
  extern __shared__ uint4 ring[];  // [PREFILL_STAGES][K, V][TILE_KEYS][D / 8] (swizzled pieces)

  const int seq = P.launch_order ? P.launch_order[blockIdx.z] : blockIdx.z;
  const int kvh = blockIdx.x / P.num_splits, split = blockIdx.x % P.num_splits;
  const int tile = gridDim.y - 1 - blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;

  const int q_start = P.query_start_loc[seq];
  const int q_len = P.query_start_loc[seq + 1] - q_start;
  const int context_len = P.context_lens[seq];
  const int num_rows = q_len * P.group;
  const int row0 = tile * TILE_ROWS;
  if (row0 >= num_rows) return;  // uniform per CTA
  const int first_pos = context_len - q_len;  // position of the sequence's first query token
  const int H = P.num_kv_heads * P.group;
  const int window = P.window > 0 ? P.window : (1 << 30);

  // The CTA's keys [range_lo, range_end): from its first row's window start to its last row, within
  // this split's partition (splits count from range_lo rounded down to a tile).
  const int cta_last = min(row0 + TILE_ROWS, num_rows) - 1;
  const int range_lo = P.window > 0 ? max(0, first_pos + row0 / P.group - window + 1) : 0;
  const int key_begin = (range_lo & ~(TILE_KEYS - 1)) + split * P.partition_size;
  const int range_end = min(key_begin + P.partition_size, first_pos + cta_last / P.group + 1);
  const int num_tiles = range_end > key_begin ? (range_end - key_begin + TILE_KEYS - 1) / TILE_KEYS : 0;
  const int* table = P.block_tables + (size_t)seq * P.max_blocks_per_seq;
  const unsigned ring_base = shared_address(ring);

  // Start tile 0's copies and fetch tile 1's slots, then fetch Q while they fly.
  int slots[KEYS_PER_THREAD<D>];
#pragma unroll
  for (int s = 0; s < PREFILL_STAGES - 1; ++s) {
    tile_slots<D>(P, table, key_begin + s * TILE_KEYS, range_lo, range_end, slots);
    if constexpr (kIsFp8<C>) {
      if (s < num_tiles) {
        uint2 k_raw[KEYS_PER_THREAD<D>], v_raw[KEYS_PER_THREAD<D>];
        load_tile_fp8<D>(P, kvh, slots, k_raw, v_raw);
        store_tile_fp8<D, T>(k_raw, v_raw, ring_base + s * STAGE_BYTES);
      }
    } else {
      if (s < num_tiles) copy_tile<D>(P, kvh, slots, ring_base + s * STAGE_BYTES);
    }
    cp_async_commit();
  }
  tile_slots<D>(P, table, key_begin + (PREFILL_STAGES - 1) * TILE_KEYS, range_lo, range_end, slots);

  // This warp's rows; a warp past the last row keeps to the barriers and computes nothing.
  const int warp_row0 = row0 + warp * WARP_ROWS;
  const bool active = warp_row0 < num_rows;
  const int row_lo = warp_row0 + g, row_hi = warp_row0 + g + 8;
  const int pos_lo = first_pos + row_lo / P.group, pos_hi = first_pos + row_hi / P.group;
  const int warp_pos_min = first_pos + warp_row0 / P.group;
  const int warp_pos_max = first_pos + (min(warp_row0 + WARP_ROWS, num_rows) - 1) / P.group;

  // Q as mma A fragments: k step kk takes d = 16kk + 2t (+1) and 16kk + 8 + 2t (+1) of rows g, g + 8.
  unsigned qa[D / 16][4];
  {
    const bool valid_lo = row_lo < num_rows, valid_hi = row_hi < num_rows;
    const T* q_lo = P.q + ((size_t)(q_start + row_lo / P.group) * H + kvh * P.group + row_lo % P.group) * D;
    const T* q_hi = P.q + ((size_t)(q_start + row_hi / P.group) * H + kvh * P.group + row_hi % P.group) * D;
    const unsigned* w_lo = reinterpret_cast<const unsigned*>(q_lo);
    const unsigned* w_hi = reinterpret_cast<const unsigned*>(q_hi);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qa[kk][0] = valid_lo ? w_lo[8 * kk + t] : 0u;
      qa[kk][1] = valid_hi ? w_hi[8 * kk + t] : 0u;
      qa[kk][2] = valid_lo ? w_lo[8 * kk + 4 + t] : 0u;
      qa[kk][3] = valid_hi ? w_hi[8 * kk + 4 + t] : 0u;
    }
  }

  WarpState<D> st;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) st.o[j][0] = st.o[j][1] = st.o[j][2] = st.o[j][3] = 0.f;
  st.m_lo = st.m_hi = neg_inf();
  st.l_lo = st.l_hi = 0.f;

  for (int i = 0; i < num_tiles; ++i) {
    // Tile i has landed once at most STAGES - 2 newer groups are pending; the barrier publishes every
    // thread's copies and says every warp is done with the stage read at i - 1, refilled at once with
    // tile i + STAGES - 1 (whose slots were fetched last iteration).
    cp_async_wait<PREFILL_STAGES - 2>();
    __syncthreads();
    const int ahead = i + PREFILL_STAGES - 1;
    uint2 k_raw[kIsFp8<C> ? KEYS_PER_THREAD<D> : 1], v_raw[kIsFp8<C> ? KEYS_PER_THREAD<D> : 1];
    if constexpr (kIsFp8<C>) {
      if (ahead < num_tiles) load_tile_fp8<D>(P, kvh, slots, k_raw, v_raw);  // stored after this tile's math
    } else {
      if (ahead < num_tiles) copy_tile<D>(P, kvh, slots, ring_base + (ahead % PREFILL_STAGES) * STAGE_BYTES);
    }
    cp_async_commit();  // also when empty: one group per tile keeps the wait count right
    tile_slots<D>(P, table, key_begin + (ahead + 1) * TILE_KEYS, range_lo, range_end, slots);
    const int k0 = key_begin + i * TILE_KEYS;
    const bool skip = k0 > warp_pos_max || k0 + TILE_KEYS - 1 <= warp_pos_min - window;
    if (active && !skip) {
      const bool masked = k0 + TILE_KEYS - 1 > warp_pos_min || k0 <= warp_pos_max - window;
      attend_tile<D, T, C>(P, qa, ring_base + (i % PREFILL_STAGES) * STAGE_BYTES, lane, k0, masked, pos_lo, pos_hi,
                        window, st);
    }
    if constexpr (kIsFp8<C>) {  // the stage of tile `ahead` was freed by this iteration's barrier
      if (ahead < num_tiles) store_tile_fp8<D, T>(k_raw, v_raw, ring_base + (ahead % PREFILL_STAGES) * STAGE_BYTES);
    }
  }
  cp_async_wait<0>();  // no copy may still be landing when the CTA exits

  if (!active) return;
  st.l_lo += __shfl_xor_sync(0xffffffffu, st.l_lo, 1);
  st.l_lo += __shfl_xor_sync(0xffffffffu, st.l_lo, 2);
  st.l_hi += __shfl_xor_sync(0xffffffffu, st.l_hi, 1);
  st.l_hi += __shfl_xor_sync(0xffffffffu, st.l_hi, 2);
  if (row_lo < num_rows) {
    const size_t th = (size_t)(q_start + row_lo / P.group) * H + kvh * P.group + row_lo % P.group;
    write_row<D, T, C>(P, th, split, t, st.o, 0, st.m_lo, st.l_lo);
  }
  if (row_hi < num_rows) {
    const size_t th = (size_t)(q_start + row_hi / P.group) * H + kvh * P.group + row_hi % P.group;
    write_row<D, T, C>(P, th, split, t, st.o, 1, st.m_hi, st.l_hi);
  }
}

}  // namespace

// One CTA of 256 threads per (kv head x split, row tile, sequence); see the top comment. D = 128 keeps
// one CTA per SM (its registers), D = 64 two. The _fp8 entry points read an FP8 cache (uint8 e4m3 bits;
// kv_scale [2] fp32 on the device = (k_scale, v_scale), read at launch) through load/store_tile_fp8.
#define DEFINE_PREFILL(D, MIN_BLOCKS, T, SUFFIX)                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) prefill_attention_d##D##_##SUFFIX(       \
      const T* q, const T* k_cache, const T* v_cache, T* out, float* partial_o, float* partial_ml,           \
      const int* block_tables, const int* context_lens, const int* query_start_loc,                          \
      const int* launch_order, int num_tokens, int num_kv_heads, int group, int block_size,                  \
      int max_blocks_per_seq, int partition_size, int num_splits, float scale_log2, int block_shift,         \
      int window) {                                                                                          \
    const Params<T> p{q, k_cache, v_cache, out, partial_o, partial_ml, block_tables, context_lens,           \
                      query_start_loc, launch_order, num_tokens, num_kv_heads, group, block_size,            \
                      max_blocks_per_seq, partition_size, num_splits, scale_log2, block_shift, window, 1.f}; \
    prefill_impl<D, T, T>(p);                                                                                \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) prefill_attention_d##D##_##SUFFIX##_fp8( \
      const T* q, const fp8_e4m3_t* k_cache, const fp8_e4m3_t* v_cache, T* out, float* partial_o,            \
      float* partial_ml, const int* block_tables, const int* context_lens, const int* query_start_loc,       \
      const int* launch_order, int num_tokens, int num_kv_heads, int group, int block_size,                  \
      int max_blocks_per_seq, int partition_size, int num_splits, float scale_log2, int block_shift,         \
      int window, const float* kv_scale) {                                                                   \
    const Params<T, fp8_e4m3_t> p{q, k_cache, v_cache, out, partial_o, partial_ml, block_tables,             \
                                  context_lens, query_start_loc, launch_order, num_tokens, num_kv_heads,     \
                                  group, block_size, max_blocks_per_seq, partition_size, num_splits,         \
                                  scale_log2 * kv_scale[0], block_shift, window, kv_scale[1]};               \
    prefill_impl<D, T, fp8_e4m3_t>(p);                                                                       \
  }
DEFINE_PREFILL(64, 2, __half, f16)
DEFINE_PREFILL(128, 1, __half, f16)
DEFINE_PREFILL(64, 2, bf16_t, bf16)
DEFINE_PREFILL(128, 1, bf16_t, bf16)
