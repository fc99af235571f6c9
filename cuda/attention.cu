// Paged causal grouped-query attention (decode, prefill, chunked prefill, mixed batches) on tensor cores.
//
// Element type T: every kernel exists for fp16 (__half, names ending _f16) and bf16 (bf16_t, _bf16: the
// bits of a bfloat16, converted with PTX cvt so that no cuda_bf16.h is needed at run time); the
// tensor-core products take T operands and accumulate in fp32 either way.
// FP8 KV cache (names ending _fp8; cache element C = fp8_e4m3_t, the pools uint8): K/V travel as raw e4m3
// bytes, and the tiles' consume converts them exactly (cuda/fp8.cuh) to fp16 where the products use them (QK^T and
// P.V run in fp16 over an FP8 cache); k_scale is folded into scale_log2 and v_scale multiplies O (finish_rows).
// The decode tiles move 16 e4m3 bytes a load, through a dense ring (FP8_WIDE_DECODE); the key-split and row-split
// tiles move 8 where a 16-bit cache moves 16 (the first half of each 16-byte ring piece). The 16-bit kernels
// compile as before (C = T).
//
// Buffers (all contiguous, T unless said):
//   q            [T, H, D]        query rows; sequence s owns rows query_start_loc[s] .. query_start_loc[s+1]-1
//   k_cache      [N, B, Hkv, D]   key pool of one layer; token p of sequence s is at
//   v_cache      [N, B, Hkv, D]   block block_tables[s, p / B], offset p % B
//   out          [T, H, D]        written for every row that belongs to a sequence
//   block_tables [S, M] int32, context_lens [S] int32 (tokens cached, this step's included),
//   query_start_loc [S + 1] int32
//   partial_o    [num_splits, T, H, D] fp32   un-normalised partial outputs (only when num_splits > 1)
//   partial_ml   [num_splits, T, H, 2] fp32   (running max in log2 units, softmax denominator)
//   window       sliding window (0 = none): a query at position p attends only to keys at positions
//                p - window < k <= p (the last `window` positions, itself included; Mistral's rule)
//
// Work decomposition. For one (sequence, kv head) the G = H / Hkv query heads and the q_len query tokens
// form q_len * G "rows" (row f = query token f / G, head kvh * G + f % G): every row of a KV head reads the
// same keys, so they share the tensor-core products and K/V are loaded once for all of them.
// A warp owns a tile of rows and walks keys 16 at a time: scores, an online softmax in registers, O += P V.
// Two tile shapes (WideTile, NarrowTile): 16 rows as the M dimension of mma.m16n8k16 (S = Q K^T), or, for
// the "decode" kernels, 8 rows as its N dimension (S^T = K Q^T, O^T += V^T P^T): one decode token's G <= 8
// heads then fill the tile with half the products. K/V reach the mma fragments through a cp.async ring in
// shared memory (decode at D = 64, decode over an FP8 cache, and every ROW_SPLIT CTA) or straight from global
// memory into registers (16-bit decode at D = 128); the head-dim permutations that make every lane load 16
// contiguous bytes are explained at key_dim / value_dim, and read_stage / read_dense take the same fragments from
// the rings.
//
// Grid: x = row tile (KEY_SPLIT, decode) or group of 4 row tiles (ROW_SPLIT), y = kv_head * num_splits + split,
//       z = sequence (launch_order[z] when the caller gives an order, else z). Block: 128 threads = 4 warps.
//   KEY_SPLIT (decode and short queries: the "decode" kernels with 8-row tiles, "keysplit" with 16): the 4
//     warps share one row tile and take interleaved 16-key chunks of the split's key range; the CTA merges
//     their (max, sum, O) through shared memory.
//   ROW_SPLIT (long prefill chunks): each warp owns its own row tile and walks all keys of the split; the
//     4 warps stage the keys of all 4 tiles into one shared ring, so each chunk is read once per CTA.
// A split is a range of partition_size keys (a multiple of 64). With num_splits > 1 every CTA writes its
// un-normalised partial O with its (max, sum) and merge_partials combines them (flash-decoding), so one
// long sequence still spreads over the whole GPU.
// With a window, a CTA's key range starts at the window start of its first row: splits count from
// there (rounded down to a multiple of 64), and a warp starts at the 16-key chunk that holds it, so no
// key block wholly before the window is read (those blocks may already be freed).
// fp8.cuh before common.cuh, which uses it
#include "fp8.cuh"
#include "common.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int CHUNK = 16;  // keys a warp consumes per step (mma K of the P.V product)
constexpr int PAD = 4;     // floats of padding per shared-memory row of O (fewer bank conflicts)
constexpr int D64_PIPELINE_DEPTH = 2;  // register pipeline: chunks of K/V requested ahead at D = 64 (1 or 2)
// cp.async rings (see attention_impl): N slots, N - 1 of them in flight while the warps compute on one;
// 0 = the register pipeline instead. Decode at D = 64 (a ring per warp; D = 128 decode always uses
// registers) and row-split CTAs (one shared ring). launchers.py keeps copies of both: they size the
// dynamic shared memory. Measured on the H200 (benchmarks/NOTES.md): decode 3 slots (2 starve it, 4 cost
// occupancy); row split 2 (3 slots of D = 128 chunks leave one CTA fewer per SM).
constexpr int DECODE_RING_STAGES = 3;
// Over an FP8 cache the decode kernels are bound by latency, not by bytes (half as many for the same work;
// bench_decode_splits.py, H200): at D = 64 a deeper ring loses (4 slots 0.159, 5 slots 0.188 against 0.143 ms)
// and registers are within noise of it (0.137-0.159); at D = 128 a register cap for 3 CTAs per SM
// (FP8_D128_MIN_CTAS; 167 registers, no spill, one chunk of keys ahead) beats 2 CTAs (0.216-0.217 against
// 0.271 ms, or 0.253-0.255 with two chunks of K and V ahead). A 16-bit D = 128 kernel capped alike spills (0.43 ms).
constexpr int DECODE_RING_STAGES_FP8 = 3;
// The decode kernels (8-row tiles) over an FP8 cache load 16 bytes where a lane needs two 8-element pieces: the
// head dims are permuted so that K's pieces c and c + 1 (and V's two at D = 128) are contiguous (key_dim,
// value_dim), and their ring holds the e4m3 bytes densely (stage_chunk's DENSE). 0: 8-byte loads in the 16-bit
// layout, as the key-split and row-split tiles keep. launchers.py keeps a copy (the ring's size).
constexpr int FP8_WIDE_DECODE = 1;
constexpr int DECODE_RING_STAGES_DENSE = 3;  // slots of that dense ring (half the bytes of a 16-bit layout's slot)
constexpr int FP8_DECODE_D128_RING = 1;  // the FP8 decode tiles at D = 128 through a dense ring too (0: registers)
#define FP8_D128_MIN_CTAS 3
#define FP8_D64_MIN_CTAS 4  // the ring's 4 CTAs per SM (48 KiB of it each): at most 128 registers
// The decode kernels (8-row tiles) need fewer registers: D = 128 fits 3 CTAs per SM in 16 bits (168 registers, no
// spill; uncapped 182 and 2 CTAs, 0.298 against 0.270 ms) and 4 over FP8 (124-126; 3 CTAs 0.192, 4 CTAs 0.177 ms).
// At D = 64 the ring's shared memory allows 4 CTAs, which 110-118 registers fit without a cap.
#define DECODE_D64_MIN_CTAS 4
#define DECODE_D128_MIN_CTAS 3
#define DECODE_FP8_D64_MIN_CTAS 4
#define DECODE_FP8_D128_MIN_CTAS 4
constexpr int PREFILL_RING_STAGES = 2;


// D = A B + D with fp32 accumulators; A, B are pairs of T packed in 32-bit registers.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                                 unsigned a3, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<bf16_t>(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                                        unsigned a3, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Halves number `h` (0..7) of two 16-byte vectors, packed as (lo from a, hi from b).
__device__ __forceinline__ unsigned pair_halves(const uint4& a, const uint4& b, int h) {
  return __byte_perm(word_of(a, h >> 1), word_of(b, h >> 1), (h & 1) ? 0x7632 : 0x5410);
}

// x rounded to T and stored at p; returns the stored value as a float.
__device__ __forceinline__ float store_float(__half* p, float x) {
  const __half h = __float2half(x);
  *p = h;
  return __half2float(h);
}
__device__ __forceinline__ float store_float(bf16_t* p, float x) {
  unsigned short bits;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(bits) : "f"(x));
  p->bits = bits;
  return __uint_as_float((unsigned)bits << 16);
}

// Eight T in a 16-byte vector as floats.
__device__ __forceinline__ void floats_of8(const uint4& v, __half, float (&f)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = pair.x;
    f[2 * i + 1] = pair.y;
  }
}
__device__ __forceinline__ void floats_of8(const uint4& v, bf16_t, float (&f)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <typename T>
__device__ __forceinline__ uint4 load16(const T* p) { return *reinterpret_cast<const uint4*>(p); }

// 16 bytes global -> shared without passing through registers (sm_80+); ok = false fills zeros and
// reads nothing. Completion is tracked in groups: commit after each chunk, wait until <= N are pending.
__device__ __forceinline__ void cp_async16(uint4* smem, const void* gmem, bool ok) {
  unsigned long long shared_addr;
  asm("cvta.to.shared.u64 %0, %1;\n" : "=l"(shared_addr) : "l"(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((unsigned)shared_addr), "l"(gmem),
               "r"(ok ? 16 : 0));
}

// 8 cache elements at p as loaded: 16 bytes of T, or the 8 e4m3 bytes in .x, .y (converted by as_elements
// where they are used, so the conversion never waits on a load that is still in flight).
template <typename C>
__device__ __forceinline__ uint4 load_kv8(const C* p) {
  if constexpr (kIsFp8<C>) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    return make_uint4(raw.x, raw.y, 0u, 0u);
  } else {
    return load16(p);
  }
}

// A ring piece's cache elements global -> shared: 16 bytes of T, or the 8 bytes of 8 e4m3 elements into
// the first half of the 16-byte piece (the ring keeps the 16-bit layout; as_elements converts at use).
template <typename C>
__device__ __forceinline__ void cp_async_kv(uint4* smem, const C* gmem, bool ok) {
  if constexpr (kIsFp8<C>) {
    unsigned long long shared_addr;
    asm("cvta.to.shared.u64 %0, %1;\n" : "=l"(shared_addr) : "l"(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"((unsigned)shared_addr), "l"(gmem),
                 "r"(ok ? 8 : 0));
  } else {
    cp_async16(smem, gmem, ok);
  }
}

// The element type of the P.V product: T, or fp16 over an FP8 cache whatever T is. P lies in [0, 1] and every
// e4m3 value is an fp16 exactly, so fp16 loses nothing there (its 10-bit mantissa holds P better than bf16's 7),
// and on sm_89+ e4m3 -> fp16 is one instruction per pair (cuda/fp8.cuh) where e4m3 -> bf16 takes six.
template <typename T, typename C>
struct PvElement {
  using type = T;
};
template <typename T>
struct PvElement<T, fp8_e4m3_t> {
  using type = __half;
};

// The element type of the QK^T product: T, or fp16 over an FP8 cache. K converts to fp16 by one instruction per
// pair on sm_89+ where bf16 takes six, and Q (converted once per tile, saturated at +-65504) keeps its bf16 bits:
// fp16's wider mantissa holds every bf16 value of fp16's range exactly.
#define FP8_QK_IN_HALF 1
template <typename T, typename C>
struct QkElement {
  using type = T;
};
#if FP8_QK_IN_HALF
template <typename T>
struct QkElement<T, fp8_e4m3_t> {
  using type = __half;
};
#endif

template <typename A, typename B>
constexpr bool kSame = false;
template <typename A>
constexpr bool kSame<A, A> = true;

// Eight T (a 16-byte load of q) as eight U: the same bits when U is T; bf16 -> fp16 saturated otherwise.
template <typename U, typename T>
__device__ __forceinline__ uint4 q_as(const uint4& x) {
  if constexpr (kSame<U, T>) {
    return x;
  } else {
    static_assert(kSame<U, __half> && kSame<T, bf16_t>, "q converts from bf16 to fp16 only");
    uint4 r;
    unsigned* out = reinterpret_cast<unsigned*>(&r);
    const unsigned* in = reinterpret_cast<const unsigned*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = fminf(fmaxf(__uint_as_float(in[i] << 16), -65504.f), 65504.f);
      const float hi = fminf(fmaxf(__uint_as_float(in[i] & 0xffff0000u), -65504.f), 65504.f);
      out[i] = pack_float2<__half>(lo, hi);
    }
    return r;
  }
}

// A loaded or staged piece (load_kv8, the ring) as 8 T, element i in half i: itself for a 16-bit cache.
template <typename T, typename C>
__device__ __forceinline__ uint4 as_elements(const uint4& piece) {
  if constexpr (kIsFp8<C>) {
    return e4m3x8_to<T>(make_uint2(piece.x, piece.y));
  } else {
    return piece;
  }
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
  const int* launch_order;  // [S]: grid slice z runs sequence launch_order[z]; null: sequence z
  int num_tokens;
  int num_kv_heads;
  int group;
  int block_size;
  int max_blocks_per_seq;
  int partition_size;
  int num_splits;
  float scale_log2;  // softmax scale * log2(e): scores live in log2 units so exp2 does the exponent
  int block_shift;   // log2(block_size) when it is a power of two, else -1
  int window;        // sliding window in positions; 0 = none
  float v_scale;     // FP8 cache: the V scale, applied to O (the K scale is folded into scale_log2)
  // The output's token rows quantized for an FP8 linear as well (null xq: not asked); see quantize_token_row.
  unsigned char* xq;  // [T, xq_width] e4m3 bytes
  float* x_scale;     // [T]
  unsigned* row_sync; // [T, 2] (amax bits, CTAs arrived), zeros between launches
  int xq_width;
  float static_scale;
};

// Slot of key k0 when its whole 16-key chunk lies in one block (block size a power of two >= 16: chunks
// start at multiples of 16), else -1. Keys at or past key_end have no table entry to read.
template <typename T, typename C>
__device__ __forceinline__ long long chunk_slot(const Params<T, C>& P, const int* table, int k0, int key_end) {
  if (P.block_shift < 4 || k0 >= key_end) return -1;
  return ((long long)table[k0 >> P.block_shift] << P.block_shift) + (k0 & ((1 << P.block_shift) - 1));
}

// Element offset of (key p, kv head kvh, dim 0) in the cache; `base` is chunk_slot of the chunk's first
// key k0 (then no table read per key), or -1 for a table lookup.
template <typename T, typename C>
__device__ __forceinline__ size_t cache_offset(const Params<T, C>& P, const int* table, long long base, int k0, int p,
                                               int kvh, int D) {
  size_t slot;
  if (base >= 0) {
    slot = base + (p - k0);
  } else if (P.block_shift >= 0) {
    slot = ((size_t)table[p >> P.block_shift] << P.block_shift) + (p & ((1 << P.block_shift) - 1));
  } else {
    slot = (size_t)table[p / P.block_size] * P.block_size + p % P.block_size;
  }
  return (slot * P.num_kv_heads + kvh) * D;
}

// The first of the 8 consecutive head dims in lane t's K piece c (c < D / 32; Q is permuted alike): 32c + 8t, one
// 16-byte load of a 16-bit cache per piece; WIDE (FP8 decode tiles): 64 (c / 2) + 16t + 8 (c % 2), so that pieces
// 2i and 2i + 1 of an e4m3 cache are one 16-byte load.
template <int D, bool WIDE>
__device__ __forceinline__ int key_dim(int c, int t) {
  return WIDE ? 64 * (c >> 1) + 16 * t + 8 * (c & 1) : 32 * c + 8 * t;
}

// The same for lane g's V piece c (c < D / 64; O's d follows it): 64c + 8g; WIDE at D = 128: 16g + 8c.
template <int D, bool WIDE>
__device__ __forceinline__ int value_dim(int c, int g) {
  return WIDE && D == 128 ? 16 * g + 8 * c : 64 * c + 8 * g;
}

// Two e4m3 pieces of one 16-byte load, each as load_kv8 gives it.
__device__ __forceinline__ void split_pieces(const uint4& raw, uint4& first, uint4& second) {
  first = make_uint4(raw.x, raw.y, 0u, 0u);
  second = make_uint4(raw.z, raw.w, 0u, 0u);
}

// load_keys: n8 tile n of a chunk holds keys k0 + 8n + g (mma column g); lane (g, t) loads the pieces of key_dim,
// matching the Q permutation. Keys >= key_end load zeros.
template <int D, bool WIDE, typename T, typename C>
__device__ __forceinline__ void load_keys(const Params<T, C>& P, const int* table, long long base, int kvh, int k0,
                                          int key_lo, int key_end, int g, int t, uint4 (&kf)[2][D / 32]) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int p = k0 + 8 * n + g;
    const bool ok = p >= key_lo && p < key_end;
    const C* src = P.k_cache + (ok ? cache_offset(P, table, base, k0, p, kvh, D) : 0);
    if constexpr (WIDE) {
#pragma unroll
      for (int c = 0; c < D / 32; c += 2) split_pieces(ok ? load16(src + key_dim<D, WIDE>(c, t)) : zero, kf[n][c],
                                                       kf[n][c + 1]);
    } else {
#pragma unroll
      for (int c = 0; c < D / 32; ++c) kf[n][c] = ok ? load_kv8(src + key_dim<D, WIDE>(c, t)) : zero;
    }
  }
}

// load_values: the P.V product's k index is the key (lane t holds keys 2t, 2t+1, 8+2t, 9+2t of the chunk,
// the order S's accumulators come in) and its n index is d, permuted so that in n8 tile j lane g holds
// d = value_dim(j / 8, g) + j % 8: per key, lane g loads D / 64 pieces (one 16-byte load of two when WIDE).
// Keys outside [key_lo, key_end) load zeros: their probability is 0, and 0 * (garbage NaN) would poison
// O; keys before key_lo (before the window) may sit in freed blocks and are never touched.
template <int D, bool WIDE, typename T, typename C>
__device__ __forceinline__ void load_values(const Params<T, C>& P, const int* table, long long base, int kvh, int k0,
                                            int key_lo, int key_end, int g, int t, uint4 (&vf)[4][D / 64]) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int p = k0 + 2 * t + (e & 1) + 8 * (e >> 1);
    const bool ok = p >= key_lo && p < key_end;
    const C* src = P.v_cache + (ok ? cache_offset(P, table, base, k0, p, kvh, D) : 0);
    if constexpr (WIDE && D == 128) {
      split_pieces(ok ? load16(src + value_dim<D, WIDE>(0, g)) : zero, vf[e][0], vf[e][1]);
    } else {
#pragma unroll
      for (int c = 0; c < D / 64; ++c) vf[e][c] = ok ? load_kv8(src + value_dim<D, WIDE>(c, g)) : zero;
    }
  }
}

// The shared-memory chunk (cp.async path): K then V, each [CHUNK keys][D / 8 pieces of 16 bytes]. Piece
// `col` of key `key` sits at col ^ swizzle(key), so that the 8 lanes of each quarter warp read 8 distinct
// 16-byte bank groups in both fragment patterns below (keys g / g + 1 of load_keys; keys 2t + const of
// load_values), with no bank conflict.
__device__ __forceinline__ int swizzle(int key) { return (((key >> 1) & 3) << 1) ^ ((key & 1) << 2); }

// The same fragments load_keys / load_values take from global memory, from a staged chunk.
template <int D>
__device__ __forceinline__ void read_stage(const uint4* stage, int g, int t, uint4 (&kf)[2][D / 32],
                                           uint4 (&vf)[4][D / 64]) {
  constexpr int PIECES = D / 8;
  const uint4* vs = stage + CHUNK * PIECES;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int c = 0; c < D / 32; ++c) kf[n][c] = stage[(8 * n + g) * PIECES + ((4 * c + t) ^ swizzle(8 * n + g))];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int key = 2 * t + (e & 1) + 8 * (e >> 1);
#pragma unroll
    for (int c = 0; c < D / 64; ++c) vf[e][c] = vs[key * PIECES + ((8 * c + g) ^ swizzle(key))];
  }
}

// The dense ring of the FP8 decode tiles (WIDE): a chunk's K then V, each 16 keys x D / 16 pairs of pieces (16
// bytes: 16 e4m3, head dims 16i .. 16i + 15). At D = 64, 8 pairs (2 keys) per 128-byte line: pair `pair` of key
// `key` sits at pair ((key & 1) * 4 + pair) ^ 2 (line & 3) of its line. At D = 128 a key is a line, its pair at
// pair ^ 2 ((key >> 1) & 3) ^ 4 (key & 1). Either way the K reads (16 bytes, keys 8n + g, pair key_dim / 16) and
// the V reads (keys 2t + const, 8 bytes of piece g at D = 64, 16 bytes of pair g at D = 128) meet no bank conflict.
template <int D>
__device__ __forceinline__ int dense_at(int key, int pair) {
  if constexpr (D == 64) {
    const int line = key >> 1;
    return line * 8 + ((((key & 1) << 2) | pair) ^ ((line & 3) << 1));
  } else {
    return key * 8 + (pair ^ (((key >> 1) & 3) << 1) ^ ((key & 1) << 2));
  }
}

// Request chunk k0's keys and values into `stage` (cp.async, not waited for), each key's D elements contiguous in
// memory. Lane i copies pieces i, i + 32, ... (four consecutive keys per instruction at D = 64) of 8 elements into
// the 16-bit layout (read_stage), or, DENSE, 16 e4m3 bytes at a time into the dense ring (dense_at, read_dense).
template <int D, bool DENSE, typename T, typename C>
__device__ __forceinline__ void stage_chunk(const Params<T, C>& P, const int* table, int kvh, int k0, int key_lo,
                                            int key_end, int lane, uint4* stage) {
  static_assert(!DENSE || ((D == 64 || D == 128) && kIsFp8<C>), "the dense ring holds e4m3 chunks of D = 64 or 128");
  constexpr int ELEMENTS = DENSE ? 16 : 8;  // cache elements a copy moves
  constexpr int COPIES = D / ELEMENTS;      // per key
  const long long base = chunk_slot(P, table, k0, key_end);
#pragma unroll
  for (int j = 0; j < CHUNK * COPIES / 32; ++j) {
    const int i = lane + 32 * j, key = i / COPIES, col = i % COPIES;
    const int p = k0 + key;
    const bool ok = p >= key_lo && p < key_end;
    const size_t offset = ok ? cache_offset(P, table, base, k0, p, kvh, D) + ELEMENTS * col : 0;
    const int at = DENSE ? dense_at<D>(key, col) : key * COPIES + (col ^ swizzle(key));
    if constexpr (DENSE) {
      cp_async16(stage + at, P.k_cache + offset, ok);
      cp_async16(stage + CHUNK * COPIES + at, P.v_cache + offset, ok);
    } else {
      cp_async_kv(stage + at, P.k_cache + offset, ok);
      cp_async_kv(stage + CHUNK * COPIES + at, P.v_cache + offset, ok);
    }
  }
}

// read_stage for the dense ring: the fragments of load_keys / load_values with WIDE.
template <int D>
__device__ __forceinline__ void read_dense(const uint4* stage, int g, int t, uint4 (&kf)[2][D / 32],
                                           uint4 (&vf)[4][D / 64]) {
  constexpr int PAIRS = D / 16;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int c = 0; c < D / 32; c += 2)
      split_pieces(stage[dense_at<D>(8 * n + g, key_dim<D, true>(c, t) / 16)], kf[n][c], kf[n][c + 1]);
  const uint4* vs = stage + CHUNK * PAIRS;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int key = 2 * t + (e & 1) + 8 * (e >> 1);
    if constexpr (D == 64) {
      const uint2 piece = reinterpret_cast<const uint2*>(vs)[2 * dense_at<D>(key, g >> 1) + (g & 1)];
      vf[e][0] = make_uint4(piece.x, piece.y, 0u, 0u);
    } else {
      split_pieces(vs[dense_at<D>(key, value_dim<D, true>(0, g) / 16)], vf[e][0], vf[e][1]);
    }
  }
}

// Combine `num_parts` (max, sum, O) partial results per row held in shared memory and write them out:
// normalised T when there is one split, else un-normalised fp32 partials for merge_partials.
// Returns the largest |value| the thread stored (NaN kept; 0 for partials).
template <int D, int ROWS_T, typename T, typename C>
__device__ float finish_rows(const Params<T, C>& P, const float* so, const float* sm, const float* sl, int num_parts,
                             int tid, int num_threads, int row0, int num_rows, int q_start, int kvh, int split) {
  const int H = P.num_kv_heads * P.group;
  float amax = 0.f;
  for (int idx = tid; idx < ROWS_T * D; idx += num_threads) {
    const int r = idx / D, d = idx % D;
    const int row = row0 + r;
    if (row >= num_rows) continue;
    float m = neg_inf();
    for (int w = 0; w < num_parts; ++w) m = fmaxf(m, sm[w * ROWS_T + r]);
    float o = 0.f, l = 0.f;
    if (m != neg_inf()) {
      for (int w = 0; w < num_parts; ++w) {
        const float weight = exp2f(sm[w * ROWS_T + r] - m);
        o += weight * so[(w * ROWS_T + r) * (D + PAD) + d];
        l += weight * sl[w * ROWS_T + r];
      }
    }
    if constexpr (kIsFp8<C>) o *= P.v_scale;  // O = sum p (stored V) x v_scale
    const int token = q_start + row / P.group;
    const int head = kvh * P.group + row % P.group;
    const size_t th = (size_t)token * H + head;
    if (P.num_splits == 1) {
      amax = nan_max(amax, fabsf(store_float(P.out + th * D + d, l > 0.f ? o / l : 0.f)));
    } else {
      const size_t base = (size_t)split * P.num_tokens * H;
      P.partial_o[(base + th) * D + d] = o;
      if (d == 0) {
        P.partial_ml[(base + th) * 2] = m;
        P.partial_ml[(base + th) * 2 + 1] = l;
      }
    }
  }
  return amax;
}

// The token row out[token] [H D] quantized as fp8_linear.cu's quantize_rows_fp8 quantizes it (same amax, scale and
// bytes), for a launch where every CTA holds rows of one token only and the token's rows are spread over all
// gridDim.x x gridDim.y CTAs of its sequence (one query token per sequence, one key split: launchers.py checks).
// Each CTA adds its largest |value| to the token's amax and counts itself in; the last CTA of the token to arrive
// reads the whole row back from L2, writes x_scale and xq, and zeroes the token's row_sync for the next launch.
// `amax`: the thread's largest |value| stored (finish_rows). Called by every thread of the CTA.
// Out of line, its arguments as scalars: inlined into the decode kernel it cost registers inside the key loop.
#ifndef ATTENTION_QUANTIZES
#define ATTENTION_QUANTIZES 1  // 0: the tail compiled out (A/B timings of the kernel without it; launchers must not ask)
#endif
template <typename T>
__device__ __noinline__ void quantize_token_row(const T* out, unsigned char* xq, float* x_scale, unsigned* row_sync,
                                                int width, int xq_width, float static_scale, float amax, int token) {
  __shared__ float warp_max[WARPS];
  __shared__ float token_amax;  // the row's amax (set for the last CTA only)
  __shared__ bool last;
  __threadfence();  // this thread's stores of out before its CTA counts itself in
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_max[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) m = nan_max(m, warp_max[w]);
    unsigned* sync = row_sync + 2 * (size_t)token;
    atomicMax(sync, __float_as_uint(m));  // |values| (and a NaN of sign 0) order as their bits do
    __threadfence();
    last = atomicAdd(sync + 1, 1u) == gridDim.x * gridDim.y - 1;
    if (last) {
      __threadfence();
      token_amax = __uint_as_float(atomicExch(sync, 0u));
      sync[1] = 0u;
    }
  }
  __syncthreads();
  if (!last) return;
  const float scale = fp8_row_scale(token_amax, static_scale);
  if (threadIdx.x == 0) x_scale[token] = scale;
  const Fp8Divisor divide = fp8_divisor(scale);
  const T* row = out + (size_t)token * width;
  unsigned char* q_row = xq + (size_t)token * xq_width;
  for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
    float f[8];
    floats_of8(__ldcg(reinterpret_cast<const uint4*>(row + c)), T{}, f);  // L2: other CTAs wrote them
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = divide(f[i]);
    *reinterpret_cast<uint2*>(q_row + c) = float8_to_e4m3x8(f);
  }
  for (int c = width + threadIdx.x; c < xq_width; c += blockDim.x) q_row[c] = 0;
}

// movmatrix: the transpose of an 8 x 8 matrix of 16-bit elements held as an mma fragment (lane (g, t) holds row
// g, columns 2t and 2t + 1; after it, the same entries of the transpose).
__device__ __forceinline__ unsigned transpose8x8(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// A warp's row tile: its Q fragments, its online softmax (O, each row's running max and sum) and what one 16-key
// chunk of K/V, already in fragments (load_keys / load_values / read_stage), does to them. Two shapes:
//   WideTile, 16 rows (keysplit, rowsplit): the rows are the M dimension of m16n8k16, S = Q K^T and O += P V.
//   NarrowTile, 8 rows (decode): the rows are the N dimension, S^T = K Q^T and O^T += V^T P^T. A decode tile holds
//     one token's G = 2..8 heads of a KV head; in M = 16 at least half of every product and of O's registers was
//     padding, here half as many mma and half of O's registers do the same work.
// Both take the K/V fragments in the same lane layout, so the loaders and rings serve both.
template <int D>
struct WideTile {
  static constexpr int ROWS = 16;
  unsigned qa[D / 16][4];  // Q as mma A fragments (head dim permuted within 32-wide slices, as K is)
  float o[D / 8][4];  // O: n8 tile j, accumulator e is row g (+8 for e >= 2), d = 64 (j / 8) + 8 (2t + e % 2) + j % 8
  float m_lo, m_hi, l_lo, l_hi;  // rows g and g + 8: max (log2 units) and this lane's part of the sum
  int pos_lo, pos_hi;            // their query positions

  // Head dim d is permuted within each 32-wide slice c so that lane (g, t) holds d = 32c + 8t .. 32c + 8t + 7
  // of its rows (one 16-byte load): k-step 2c takes halves 0-3, k-step 2c+1 halves 4-7. K's B fragments use
  // the same permutation, and a dot product does not care about the order of d.
  template <bool WIDE, typename T, typename C>  // (WIDE: the decode tiles' only)
  __device__ __forceinline__ void init(const Params<T, C>& P, int q_start, int kvh, int row0, int num_rows,
                                       int first_pos, int g, int t) {
    static_assert(!WIDE, "16-row tiles load K/V in the 16-bit layout");
    const int H = P.num_kv_heads * P.group;
    const int row_lo = row0 + g, row_hi = row0 + g + 8;
    pos_lo = first_pos + row_lo / P.group;
    pos_hi = first_pos + row_hi / P.group;
    const T* q_lo = P.q + ((size_t)(q_start + row_lo / P.group) * H + kvh * P.group + row_lo % P.group) * D;
    const T* q_hi = P.q + ((size_t)(q_start + row_hi / P.group) * H + kvh * P.group + row_hi % P.group) * D;
    const bool valid_lo = row_lo < num_rows, valid_hi = row_hi < num_rows;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      using QK = typename QkElement<T, C>::type;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      const uint4 lo = valid_lo ? q_as<QK, T>(load16(q_lo + key_dim<D, false>(c, t))) : zero;
      const uint4 hi = valid_hi ? q_as<QK, T>(load16(q_hi + key_dim<D, false>(c, t))) : zero;
      qa[2 * c][0] = lo.x; qa[2 * c][1] = hi.x; qa[2 * c][2] = lo.y; qa[2 * c][3] = hi.y;
      qa[2 * c + 1][0] = lo.z; qa[2 * c + 1][1] = hi.z; qa[2 * c + 1][2] = lo.w; qa[2 * c + 1][3] = hi.w;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    m_lo = m_hi = neg_inf();
    l_lo = l_hi = 0.f;
  }

  // Chunk k0: S = Q K^T, scale and masks, online softmax, O += P V.
  template <typename T, typename C>
  __device__ __forceinline__ void consume(const Params<T, C>& P, const uint4 (&kf)[2][D / 32],
                                          const uint4 (&vf)[4][D / 64], int k0, int key_end, int window, int g,
                                          int t) {
    using QK = typename QkElement<T, C>::type;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        const uint4 k = as_elements<QK, C>(kf[n][c]);
        mma16816<QK>(s[n], qa[2 * c][0], qa[2 * c][1], qa[2 * c][2], qa[2 * c][3], k.x, k.y);
        mma16816<QK>(s[n], qa[2 * c + 1][0], qa[2 * c + 1][1], qa[2 * c + 1][2], qa[2 * c + 1][3], k.z, k.w);
      }
    }
    // Scale, causal mask (key position <= the row's query position), window mask and range mask.
    float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int p = k0 + 8 * n + 2 * t + (e & 1);
        const int pos = e < 2 ? pos_lo : pos_hi;
        s[n][e] = (p < key_end && p <= pos && p > pos - window) ? s[n][e] * P.scale_log2 : neg_inf();
      }
      mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    // A row that has seen only masked keys keeps max -inf; subtract 0 then so no (-inf) - (-inf) = NaN.
    const float base_lo = new_lo == neg_inf() ? 0.f : new_lo;
    const float base_hi = new_hi == neg_inf() ? 0.f : new_hi;
    const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
    m_lo = new_lo;
    m_hi = new_hi;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = exp2f(s[n][0] - base_lo);
      s[n][1] = exp2f(s[n][1] - base_lo);
      s[n][2] = exp2f(s[n][2] - base_hi);
      s[n][3] = exp2f(s[n][3] - base_hi);
    }
    l_lo = l_lo * alpha_lo + s[0][0] + s[0][1] + s[1][0] + s[1][1];  // per-lane partial; quad-summed in stash
    l_hi = l_hi * alpha_hi + s[0][2] + s[0][3] + s[1][2] + s[1][3];
    // S accumulators of the two n8 tiles are exactly the A fragment of P for a k16 step.
    using TV = typename PvElement<T, C>::type;
    const unsigned pa0 = pack_float2<TV>(s[0][0], s[0][1]), pa1 = pack_float2<TV>(s[0][2], s[0][3]);
    const unsigned pa2 = pack_float2<TV>(s[1][0], s[1][1]), pa3 = pack_float2<TV>(s[1][2], s[1][3]);
    uint4 v[4][D / 64];  // the chunk's values as TV (an FP8 cache's converted here, after the softmax)
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int c = 0; c < D / 64; ++c) v[e][c] = as_elements<TV, C>(vf[e][c]);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha_lo; o[j][1] *= alpha_lo; o[j][2] *= alpha_hi; o[j][3] *= alpha_hi;
      const unsigned b0 = pair_halves(v[0][j / 8], v[1][j / 8], j % 8);
      const unsigned b1 = pair_halves(v[2][j / 8], v[3][j / 8], j % 8);
      mma16816<TV>(o[j], pa0, pa1, pa2, pa3, b0, b1);
    }
  }

  // Each row's sum over its quad, then (max, sum, O) to this warp's part of shared memory, O in natural d order.
  template <bool WIDE>
  __device__ __forceinline__ void stash(float* my_o, float* my_m, float* my_l, int g, int t) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e >> 1);
        const int d = 64 * (j / 8) + 8 * (2 * t + (e & 1)) + j % 8;
        my_o[r * (D + PAD) + d] = o[j][e];
      }
    }
    if (t == 0) {
      my_m[g] = m_lo;
      my_m[g + 8] = m_hi;
      my_l[g] = l_lo;
      my_l[g + 8] = l_hi;
    }
  }
};

template <int D>
struct NarrowTile {
  static constexpr int ROWS = 8;
  unsigned qb[D / 16][2];  // Q^T as mma B fragments: lane (g, t) holds row g, d permuted as WideTile's
  float o[D / 16][4];      // O^T: m16 tile j, accumulator e is d = 64 (j / 4) + 8g + 2 (j % 4) + e / 2, row 2t + e % 2
  float m0, m1, l0, l1;    // rows 2t and 2t + 1: max (log2 units) and this lane's part of the sum
  int pos0, pos1;          // their query positions

  template <bool WIDE, typename T, typename C>
  __device__ __forceinline__ void init(const Params<T, C>& P, int q_start, int kvh, int row0, int num_rows,
                                       int first_pos, int g, int t) {
    using QK = typename QkElement<T, C>::type;
    const int H = P.num_kv_heads * P.group;
    const int row = row0 + g;
    pos0 = first_pos + (row0 + 2 * t) / P.group;
    pos1 = first_pos + (row0 + 2 * t + 1) / P.group;
    const T* q = P.q + ((size_t)(q_start + row / P.group) * H + kvh * P.group + row % P.group) * D;
    const bool valid = row < num_rows;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const uint4 x = valid ? q_as<QK, T>(load16(q + key_dim<D, WIDE>(c, t))) : make_uint4(0, 0, 0, 0);
      qb[2 * c][0] = x.x; qb[2 * c][1] = x.y; qb[2 * c + 1][0] = x.z; qb[2 * c + 1][1] = x.w;
    }
#pragma unroll
    for (int j = 0; j < D / 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    m0 = m1 = neg_inf();
    l0 = l1 = 0.f;
  }

  // Chunk k0: S^T = K Q^T (the keys k0 + g and k0 + g + 8 of load_keys as the A fragment's rows), scale and masks,
  // online softmax per column, P^T to a B fragment by transposing its two 8 x 8 halves, O^T += V^T P^T (V's
  // pieces of load_values as A fragments: lane g's d = 64c + 8g + h, keys 2t, 2t + 1, 2t + 8, 2t + 9).
  template <typename T, typename C>
  __device__ __forceinline__ void consume(const Params<T, C>& P, const uint4 (&kf)[2][D / 32],
                                          const uint4 (&vf)[4][D / 64], int k0, int key_end, int window, int g,
                                          int t) {
    using QK = typename QkElement<T, C>::type;
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};  // two chains of mma, summed after
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const uint4 lo = as_elements<QK, C>(kf[0][c]), hi = as_elements<QK, C>(kf[1][c]);
      mma16816<QK>(s, lo.x, hi.x, lo.y, hi.y, qb[2 * c][0], qb[2 * c][1]);
      mma16816<QK>(s_odd, lo.z, hi.z, lo.w, hi.w, qb[2 * c + 1][0], qb[2 * c + 1][1]);
    }
    // s[e]: key k0 + g + 8 (e / 2), row 2t + e % 2. Scale, causal, window and range masks.
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int p = k0 + g + 8 * (e >> 1);
      const int pos = (e & 1) ? pos1 : pos0;
      s[e] = (p < key_end && p <= pos && p > pos - window) ? (s[e] + s_odd[e]) * P.scale_log2 : neg_inf();
    }
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int lanes = 4; lanes < 32; lanes *= 2) {  // over g: the lanes holding the column's other keys
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, lanes));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, lanes));
    }
    const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
    // A row that has seen only masked keys keeps max -inf; subtract 0 then so no (-inf) - (-inf) = NaN.
    const float base0 = new0 == neg_inf() ? 0.f : new0;
    const float base1 = new1 == neg_inf() ? 0.f : new1;
    const float alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1);
    m0 = new0;
    m1 = new1;
    s[0] = exp2f(s[0] - base0);
    s[1] = exp2f(s[1] - base1);
    s[2] = exp2f(s[2] - base0);
    s[3] = exp2f(s[3] - base1);
    l0 = l0 * alpha0 + s[0] + s[2];  // per-lane partial; summed over g in stash
    l1 = l1 * alpha1 + s[1] + s[3];
    using TV = typename PvElement<T, C>::type;
    const unsigned b0 = transpose8x8(pack_float2<TV>(s[0], s[1]));  // keys 2t, 2t + 1 of row g
    const unsigned b1 = transpose8x8(pack_float2<TV>(s[2], s[3]));  // keys 2t + 8, 2t + 9
    uint4 v[4][D / 64];  // the chunk's values as TV (an FP8 cache's converted here, after the softmax)
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int c = 0; c < D / 64; ++c) v[e][c] = as_elements<TV, C>(vf[e][c]);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const int c = j / 4, h = 2 * (j % 4);
      o[j][0] *= alpha0; o[j][1] *= alpha1; o[j][2] *= alpha0; o[j][3] *= alpha1;
      mma16816<TV>(o[j], pair_halves(v[0][c], v[1][c], h), pair_halves(v[0][c], v[1][c], h + 1),
                   pair_halves(v[2][c], v[3][c], h), pair_halves(v[2][c], v[3][c], h + 1), b0, b1);
    }
  }

  // Each row's sum over g, then (max, sum, O) to this warp's part of shared memory, O in natural d order.
  template <bool WIDE>
  __device__ __forceinline__ void stash(float* my_o, float* my_m, float* my_l, int g, int t) {
#pragma unroll
    for (int lanes = 4; lanes < 32; lanes *= 2) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, lanes);
      l1 += __shfl_xor_sync(0xffffffffu, l1, lanes);
    }
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 2 * t + (e & 1);
        const int d = value_dim<D, WIDE>(j / 4, g) + 2 * (j % 4) + (e >> 1);
        my_o[r * (D + PAD) + d] = o[j][e];
      }
    }
    if (g == 0) {
      my_m[2 * t] = m0;
      my_m[2 * t + 1] = m1;
      my_l[2 * t] = l0;
      my_l[2 * t + 1] = l1;
    }
  }
};

template <int D, bool ROW_SPLIT, typename T, typename C, typename Tile>
__device__ void attention_impl(const Params<T, C>& P) {
  constexpr int ROWS_T = Tile::ROWS;
  static_assert(D == 64 || D == 128, "head dim must be 64 or 128");
  // Where K/V go on their way to the mma fragments: a cp.async ring in dynamic shared memory (sized by
  // the launcher's ring_bytes), or registers. Decode (KEY_SPLIT) at D = 64: a ring per warp. ROW_SPLIT:
  // one ring per CTA, filled and read by its 4 warps together, so each chunk of K/V is read from memory
  // once per CTA instead of once per warp. 16-bit D = 128 decode keeps the register pipeline; FP8 decode tiles use
  // the dense ring at both head dims (FP8_DECODE_D128_RING).
  // FP8 decode tiles: 16-byte loads of two pieces (key_dim, value_dim) and, in a ring, the dense layout.
  constexpr bool WIDE = kIsFp8<C> && ROWS_T == 8 && FP8_WIDE_DECODE;
  constexpr int RING = ROW_SPLIT ? PREFILL_RING_STAGES
                     : WIDE      ? (D == 64 || FP8_DECODE_D128_RING ? DECODE_RING_STAGES_DENSE : 0)
                     : D == 64   ? (kIsFp8<C> ? DECODE_RING_STAGES_FP8 : DECODE_RING_STAGES)
                                 : 0;
  constexpr bool ASYNC = RING > 0;
  constexpr bool SHARED = ASYNC && ROW_SPLIT;
  constexpr int STAGES = ASYNC ? RING : 1;
  constexpr bool DENSE = WIDE && ASYNC && !SHARED;
  constexpr int CHUNK_PIECES = (DENSE ? 1 : 2) * CHUNK * D / 8;  // uint4 per staged chunk (K and V)
  // [STAGES][WARPS][CHUNK_PIECES] (SHARED: slot s holds 4 consecutive chunks) or [WARPS][STAGES][...]
  extern __shared__ uint4 ring[];
  // After the key loop the ring is free: the async paths put the warps' O there instead.
  __shared__ float s_o_static[ASYNC ? 1 : WARPS * ROWS_T * (D + PAD)];
  float* s_o = ASYNC ? reinterpret_cast<float*>(ring) : s_o_static;
  static_assert(!ASYNC || (STAGES >= 2 && WARPS * STAGES * CHUNK_PIECES * 16 >= WARPS * ROWS_T * (D + PAD) * 4),
                "the cp.async ring needs 2+ stages and must hold the warps' O");
  __shared__ float s_m[WARPS * ROWS_T];
  __shared__ float s_l[WARPS * ROWS_T];

  const int seq = P.launch_order ? P.launch_order[blockIdx.z] : blockIdx.z;
  const int kvh = blockIdx.y / P.num_splits;
  const int split = blockIdx.y % P.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;  // mma "group" (row / column) and "thread in group"

  const int q_start = P.query_start_loc[seq];
  const int q_len = P.query_start_loc[seq + 1] - q_start;
  const int context_len = P.context_lens[seq];
  const int num_rows = q_len * P.group;
  const int tile = ROW_SPLIT ? blockIdx.x * WARPS + warp : blockIdx.x;
  const int row0 = tile * ROWS_T;
  const int cta_row0 = ROW_SPLIT ? blockIdx.x * WARPS * ROWS_T : row0;
  if (cta_row0 >= num_rows) return;  // uniform per CTA
  // A ROW_SPLIT warp past the last row has no rows: with a shared ring it still stages its chunks and
  // meets the barriers; without one it leaves (those warps share no barrier).
  const bool active = row0 < num_rows;
  if (!SHARED && !active) return;

  const int first_pos = context_len - q_len;  // position of the sequence's first query token
  const int last_row = min(row0 + ROWS_T, num_rows) - 1;
  // The window starts at key_lo for this tile's first (earliest) row; later rows mask more keys below.
  const int window = P.window > 0 ? P.window : (1 << 30);
  const int key_lo = P.window > 0 ? max(0, first_pos + row0 / P.group - window + 1) : 0;
  // The keys the CTA reads, [range_lo, range_end): a shared ring's cover every tile of the CTA (from the
  // first tile's window start to the last tile's last row), else they are the tile's own. Splits count
  // from the range's window start, rounded down to a multiple of 64 (launchers.key_span bounds the span).
  const int range_row0 = SHARED ? cta_row0 : row0;
  const int range_last = SHARED ? min(cta_row0 + WARPS * ROWS_T, num_rows) - 1 : last_row;
  const int range_lo = P.window > 0 ? max(0, first_pos + range_row0 / P.group - window + 1) : 0;
  const int key_begin = (range_lo & ~63) + split * P.partition_size;
  const int range_end = min(min(key_begin + P.partition_size, context_len), first_pos + range_last / P.group + 1);
  const int key_end = min(range_end, first_pos + last_row / P.group + 1);  // past this tile's last row
  const int* table = P.block_tables + (size_t)seq * P.max_blocks_per_seq;

  Tile st;
  st.template init<WIDE>(P, q_start, kvh, row0, num_rows, first_pos, g, t);
  uint4 kf[2][D / 32], vf[4][D / 64];
  const int start_key = max(key_begin, range_lo & ~(CHUNK - 1));  // the chunk holding the window start

  if constexpr (SHARED) {
    // Ring slot s holds the 64 keys from k_slot = start_key + 64 i (i: the loop count); warp w stages
    // chunk w of it. One barrier per slot: it publishes every warp's copies of this slot and tells that
    // every warp is done with the previous slot, which is refilled right after it.
    constexpr int SLOT_KEYS = WARPS * CHUNK;
    const int my_first = key_lo & ~(CHUNK - 1);  // this tile's first chunk with a key in its window
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      stage_chunk<D, false>(P, table, kvh, start_key + s * SLOT_KEYS + warp * CHUNK, range_lo, range_end, lane,
                            ring + (s * WARPS + warp) * CHUNK_PIECES);
      cp_async_commit();
    }
    int slot = 0;
    for (int k_slot = start_key; k_slot < range_end; k_slot += SLOT_KEYS) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int refill = slot == 0 ? STAGES - 1 : slot - 1;
      stage_chunk<D, false>(P, table, kvh, k_slot + (STAGES - 1) * SLOT_KEYS + warp * CHUNK, range_lo, range_end,
                            lane, ring + (refill * WARPS + warp) * CHUNK_PIECES);
      cp_async_commit();  // also when empty (past range_end): the group count stays one per slot
      if (active) {
        for (int c = 0; c < WARPS; ++c) {
          const int k0 = k_slot + c * CHUNK;
          if (k0 >= key_end) break;
          if (k0 < my_first) continue;
          read_stage<D>(ring + (slot * WARPS + c) * CHUNK_PIECES, g, t, kf, vf);
          st.consume(P, kf, vf, k0, key_end, window, g, t);
        }
      }
      slot = slot == STAGES - 1 ? 0 : slot + 1;
    }
  } else if constexpr (ASYNC) {
    // A ring per warp: the 4 warps take interleaved chunks; STAGES - 1 of a warp's chunks are in flight
    // while it computes on one.
    const int stride = CHUNK * WARPS;
    const int first_key = start_key + warp * CHUNK;
    uint4* my_ring = ring + warp * STAGES * CHUNK_PIECES;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      stage_chunk<D, DENSE>(P, table, kvh, first_key + s * stride, key_lo, key_end, lane, my_ring + s * CHUNK_PIECES);
      cp_async_commit();
    }
    int slot = 0;
    for (int k0 = first_key; k0 < key_end; k0 += stride) {
      // Chunk k0 has landed once at most STAGES - 2 newer groups are pending; the warp barrier makes every
      // lane's copies visible and also means all lanes are done reading the slot refilled just below.
      cp_async_wait<STAGES - 2>();
      __syncwarp();
      if constexpr (DENSE) {
        read_dense<D>(my_ring + slot * CHUNK_PIECES, g, t, kf, vf);
      } else {
        read_stage<D>(my_ring + slot * CHUNK_PIECES, g, t, kf, vf);
      }
      const int refill = slot == 0 ? STAGES - 1 : slot - 1;  // the slot read last iteration
      stage_chunk<D, DENSE>(P, table, kvh, k0 + (STAGES - 1) * stride, key_lo, key_end, lane,
                            my_ring + refill * CHUNK_PIECES);
      cp_async_commit();  // also when empty (past key_end): the group count stays one per chunk
      slot = slot == STAGES - 1 ? 0 : slot + 1;
      st.consume(P, kf, vf, k0, key_end, window, g, t);
    }
  } else {
    // Register pipeline: the next chunk's keys (and, for D = 64 where registers allow, its values) are
    // requested before this chunk's arithmetic, so a warp always has loads in flight. DEPTH chunks ahead
    // (D = 64 only): a D = 64 chunk is half the bytes of a D = 128 one, so one chunk ahead leaves too few
    // bytes in flight per SM to cover the memory latency.
    constexpr bool PREFETCH_V = D == 64;
    constexpr int DEPTH = PREFETCH_V ? D64_PIPELINE_DEPTH : 1;
    const int stride = ROW_SPLIT ? CHUNK : CHUNK * WARPS;
    const int first_key = start_key + (ROW_SPLIT ? 0 : warp * CHUNK);
    uint4 ka[2][D / 32], va[4][D / 64];  // the chunk after the next (DEPTH 2)
    long long base = chunk_slot(P, table, first_key, key_end);
    load_keys<D, WIDE>(P, table, base, kvh, first_key, key_lo, key_end, g, t, kf);
    if (PREFETCH_V) load_values<D, WIDE>(P, table, base, kvh, first_key, key_lo, key_end, g, t, vf);
    if (DEPTH == 2) {
      const long long ahead = chunk_slot(P, table, first_key + stride, key_end);
      load_keys<D, WIDE>(P, table, ahead, kvh, first_key + stride, key_lo, key_end, g, t, ka);
      load_values<D, WIDE>(P, table, ahead, kvh, first_key + stride, key_lo, key_end, g, t, va);
    }
    for (int k0 = first_key; k0 < key_end; k0 += stride) {
      uint4 kn[2][D / 32], vn[4][D / 64];
      const int next_key = k0 + DEPTH * stride;
      const long long next_base = chunk_slot(P, table, next_key, key_end);
      if (!PREFETCH_V) load_values<D, WIDE>(P, table, base, kvh, k0, key_lo, key_end, g, t, vf);
      load_keys<D, WIDE>(P, table, next_base, kvh, next_key, key_lo, key_end, g, t, kn);
      if (PREFETCH_V) load_values<D, WIDE>(P, table, next_base, kvh, next_key, key_lo, key_end, g, t, vn);
      st.consume(P, kf, vf, k0, key_end, window, g, t);
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
          kf[n][c] = DEPTH == 2 ? ka[n][c] : kn[n][c];
          if (DEPTH == 2) ka[n][c] = kn[n][c];
        }
      if (PREFETCH_V) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            vf[e][c] = DEPTH == 2 ? va[e][c] : vn[e][c];
            if (DEPTH == 2) va[e][c] = vn[e][c];
          }
      }
      base = next_base;
    }
  }
  if constexpr (ASYNC) {  // the ring becomes s_o: no copy may still land, no warp may still read it
    cp_async_wait<0>();
    __syncthreads();
  }
  if (!active) return;  // (after the CTA's last barrier)
  float* my_o = s_o + warp * ROWS_T * (D + PAD);
  st.template stash<WIDE>(my_o, s_m + warp * ROWS_T, s_l + warp * ROWS_T, g, t);
  if (ROW_SPLIT) {
    __syncwarp();
    finish_rows<D, ROWS_T, T, C>(P, my_o, s_m + warp * ROWS_T, s_l + warp * ROWS_T, 1, lane, 32, row0, num_rows,
                                 q_start, kvh, split);
  } else {
    __syncthreads();
    const float amax = finish_rows<D, ROWS_T, T, C>(P, s_o, s_m, s_l, WARPS, threadIdx.x, blockDim.x, row0, num_rows,
                                                    q_start, kvh, split);
    if (ATTENTION_QUANTIZES && P.xq != nullptr) {
      quantize_token_row(P.out, P.xq, P.x_scale, P.row_sync, P.num_kv_heads * P.group * D, P.xq_width,
                         P.static_scale, amax, q_start);
    }
  }
}

}  // namespace

// One CTA of 128 threads per (row tile or 4 row tiles, kv head x split, sequence); see the top comment.
// The _fp8 entry points read an FP8 cache (uint8 e4m3 bits) and take kv_scale [2] fp32 on the device =
// (k_scale, v_scale), read at launch (so a CUDA graph replays whatever scales the buffer holds): the
// scores use scale_log2 * k_scale, the output O * v_scale. The 16-bit entry points take no kv_scale.
#define DEFINE_ATTENTION(D, MODE, ROW_SPLIT, TILE, T, SUFFIX, MIN_CTAS, FP8_MIN_CTAS)                             \
  extern "C" __global__ void __launch_bounds__(128, MIN_CTAS) paged_attention_d##D##_##MODE##_##SUFFIX(           \
      const T* q, const T* k_cache, const T* v_cache, T* out, float* partial_o, float* partial_ml,                \
      const int* block_tables, const int* context_lens, const int* query_start_loc,                               \
      const int* launch_order, int num_tokens, int num_kv_heads, int group, int block_size,                       \
      int max_blocks_per_seq, int partition_size, int num_splits, float scale_log2, int block_shift,              \
      int window, unsigned char* xq, float* x_scale, unsigned* row_sync, int xq_width, float static_scale) {      \
    const Params<T> p{q, k_cache, v_cache, out, partial_o, partial_ml, block_tables, context_lens,                \
                      query_start_loc, launch_order, num_tokens, num_kv_heads, group, block_size,                 \
                      max_blocks_per_seq, partition_size, num_splits, scale_log2, block_shift, window, 1.f,       \
                      xq, x_scale, row_sync, xq_width, static_scale};                                             \
    attention_impl<D, ROW_SPLIT, T, T, TILE<D>>(p);                                                               \
  }                                                                                                               \
  extern "C" __global__ void __launch_bounds__(128, FP8_MIN_CTAS) paged_attention_d##D##_##MODE##_##SUFFIX##_fp8( \
      const T* q, const fp8_e4m3_t* k_cache, const fp8_e4m3_t* v_cache, T* out, float* partial_o,                 \
      float* partial_ml, const int* block_tables, const int* context_lens, const int* query_start_loc,            \
      const int* launch_order, int num_tokens, int num_kv_heads, int group, int block_size,                       \
      int max_blocks_per_seq, int partition_size, int num_splits, float scale_log2, int block_shift,              \
      int window, const float* kv_scale, unsigned char* xq, float* x_scale, unsigned* row_sync, int xq_width,      \
      float static_scale) {                                                                                       \
    const Params<T, fp8_e4m3_t> p{q, k_cache, v_cache, out, partial_o, partial_ml, block_tables,                  \
                                  context_lens, query_start_loc, launch_order, num_tokens, num_kv_heads,          \
                                  group, block_size, max_blocks_per_seq, partition_size, num_splits,              \
                                  scale_log2 * kv_scale[0], block_shift, window, kv_scale[1],                     \
                                  xq, x_scale, row_sync, xq_width, static_scale};                                 \
    attention_impl<D, ROW_SPLIT, T, fp8_e4m3_t, TILE<D>>(p);                                                      \
  }
#define DEFINE_ATTENTION_ALL(T, SUFFIX)                                                                           \
  DEFINE_ATTENTION(64, keysplit, false, WideTile, T, SUFFIX, 1, FP8_D64_MIN_CTAS)                                 \
  DEFINE_ATTENTION(64, rowsplit, true, WideTile, T, SUFFIX, 1, 1)                                                 \
  DEFINE_ATTENTION(128, keysplit, false, WideTile, T, SUFFIX, 1, FP8_D128_MIN_CTAS)                               \
  DEFINE_ATTENTION(128, rowsplit, true, WideTile, T, SUFFIX, 1, 1)                                                \
  DEFINE_ATTENTION(64, decode, false, NarrowTile, T, SUFFIX, DECODE_D64_MIN_CTAS, DECODE_FP8_D64_MIN_CTAS)        \
  DEFINE_ATTENTION(128, decode, false, NarrowTile, T, SUFFIX, DECODE_D128_MIN_CTAS, DECODE_FP8_D128_MIN_CTAS)
DEFINE_ATTENTION_ALL(__half, f16)
DEFINE_ATTENTION_ALL(bf16_t, bf16)

// merge_partials: out[t, h, :] = sum_s w_s O_s / sum_s w_s l_s with w_s = 2^(m_s - max_s m_s).
// Grid: one CTA of D threads per (token, head) row; thread = d. Rows of no sequence (padding tokens past
// query_start_loc[S]) were never written: the launcher zeroes partial_ml, so their sums are 0 and out = 0.
// Splits that saw no key in range (wholly before a sliding window) have max -inf and weight 0.
template <typename T>
__device__ void merge_partials_impl(const float* partial_o, const float* partial_ml, T* out, int num_splits,
                                    int num_rows, int D) {
  const int row = blockIdx.x;  // token * H + head
  const int d = threadIdx.x;
  float m = neg_inf();
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, partial_ml[((size_t)s * num_rows + row) * 2]);
  float o = 0.f, l = 0.f;
  if (m != neg_inf()) {
    for (int s = 0; s < num_splits; ++s) {
      const size_t i = (size_t)s * num_rows + row;
      const float w = exp2f(partial_ml[i * 2] - m);
      o += w * partial_o[i * D + d];
      l += w * partial_ml[i * 2 + 1];
    }
  }
  store_float(out + (size_t)row * D + d, l > 0.f ? o / l : 0.f);
}

#define DEFINE_MERGE(T, SUFFIX)                                                                          \
  extern "C" __global__ void merge_partials_##SUFFIX(const float* partial_o, const float* partial_ml,    \
                                                     T* out, int num_splits, int num_rows, int D) {      \
    merge_partials_impl<T>(partial_o, partial_ml, out, num_splits, num_rows, D);                         \
  }
DEFINE_MERGE(__half, f16)
DEFINE_MERGE(bf16_t, bf16)
