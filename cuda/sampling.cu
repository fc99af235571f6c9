// Sampling on the GPU: the NumPy sampler (offline_paged/worker/sampler.py) in float64, so only the sampled ids and
// the requested log-probabilities cross to the host. Legend: R sampled rows, K logits rows, V vocab,
// Rp rows with penalties, Rs rows with top-k or top-p, P penalty tokens, Q banned (row, token) pairs.
// Every kernel is compiled without FMA contraction in the places where NumPy rounds twice (explicit __d*_rn).
//
// prepare_rows
//   logits [K, V] fp32 contiguous; rows [R] int32 (row of logits each sampled row reads)
//   adjusted [R, V] fp64 (out): the row as float64, to be penalised / banned in place
//   raw_stats [R, 2] fp64 (out): (max, log(sum(exp(x - max)))) of the raw row: logprob = (x - max) - lse
//   (OnlineStats: fp32 per thread, combined in fp64; ~1e-6 relative, the race's own bits)
//   Grid: x = sampled row; block: 1024 threads striding over V, shared-memory reductions.
//
// count_tokens
//   tokens [P, 3] int32: (penalty slot in [0, Rp), token id in [0, V), 1 if an output token else 0)
//   seen [Rp, V] int32 (zeroed; out): 1 where the token occurs in prompt or output
//   counts [Rp, V] int32 (zeroed; out): occurrences among the output tokens (atomicAdd)
//   Grid-stride loop over P, one token per thread.
//
// apply_penalties
//   adjusted [R, V] fp64 (in place); penalty_rows [Rp] int32 (row of adjusted of each slot)
//   penalties [Rp, 3] fp64: (repetition, frequency, presence); seen, counts as above
//   x = seen && rep != 1 ? (x > 0 ? x / rep : x * rep) : x;  x -= freq * count + presence * (count > 0)
//   Grid: x = chunks of 256 vocab entries, y = penalty slot; block: 256 threads, one entry each.
//
// ban_tokens
//   adjusted [R, V] fp64 (in place); pairs [Q, 2] int32 (row, token): set to -inf. Grid-stride over Q.
//
// apply_token_bitmask (structured output; before every other adjustment, as the host sampler)
//   adjusted [R, V] fp64 (in place); mask_rows [Rm] int32 (row of adjusted of each masked slot)
//   bitmask [Rm, W] int32: bit t of word w is token 32 w + t (llguidance's packing); a clear bit sets the
//   entry to -inf, and so does any token past 32 W. Grid: x = chunks of 256 vocab entries, y = masked slot;
//   block: 256 threads, one entry each.
//
// top_cut / top_cut_logits (every row; rows without top-k / top-p, and greedy rows, get -inf). No sort, so it
// can be captured. top_cut_logits reads float64(logits[rows[r]]) in place of adjusted[r]; top_cut_logits_masked
// too, with bitmask [R, W] int32 applied as apply_token_bitmask would (a clear bit, or a token past 32 W: -inf).
//   adjusted [R, V] fp64; params [R, 8] fp64 (see race); cut [R] fp64 (out): the race keeps x >= cut
//   x_j = adjusted_j / temperature. top-k: kth = (the k-th largest adjusted value) / temperature (ties kept),
//   found by a bit-by-bit descent over order_key(adjusted) (64 counting passes). top-p on the survivors
//   x >= kth: p_j = exp((x_j - max) - lse); a value stays when the mass strictly above it is < top_p (NumPy's
//   descending-cumsum rule), i.e. the cut is the largest key t with sum(p_j : key(x_j) >= t) >= top_p
//   (65 passes); all survivors stay when the whole mass rounds below top_p. Sums are block reductions in a fixed order: the same bits on every launch.
//   Grid: x = row; block: 1024 threads striding over V.
//
// gather_row_params (the sampling graph's prologue)
//   slot_rows [b] int32 (persistent row of each bucket slot, -1 = padding); sample_positions [b] int32
//   row_params [Rp, 8] fp64, row_seeds [Rp] uint64: written when a row is added, not every step
//   params [b, 8] fp64, seeds [b] uint64, positions [b] uint64 (out); padding slots are greedy.
//   One thread per slot.
//
// chosen_ids: out [R, 2] fp64 (race's output) -> token_ids [R] int32. One thread per row.
//
// race (eager: reads adjusted) and race_part + race_merge (the decode graph's race_logits: reads
// float64(logits[rows[r]]) in place; _masked with bitmask [R, W] applied as in top_cut_logits_masked: the masked
// graph's sampler, the same tokens and raw logprobs as prepare_rows -> apply_token_bitmask -> top_cut -> race
// without the copy)
//   adjusted [R, V] fp64; cut [R] fp64 (-inf: no top-k / top-p); logits, rows as above
//   params [R, 8] fp64: (temperature, min_p, greedy flag, unused...) ; seeds [R] uint64; positions [R] uint64
//   out [R, 2] fp64 (out): (token id, raw logprob of that token, from the raw row's OnlineStats)
//   greedy: argmax of adjusted (first index on ties). Otherwise x = adjusted / T, kept = x >= cut and
//   p > 0, min-p on the renormalised survivors, then argmax_i p_i / (0 - log u_i) with
//   u_i = ((splitmix64(seed * A + position * B + i) >> 11) + 0.5) * 2^-53 (random_stream.py).
//   Rows without min-p find that argmax through an fp32 filter and an exact float64 check of the few
//   entries it leaves (see race_impl); min-p rows run the float64 race over every entry.
//   race: grid x = sampled row; block: 1024 threads striding over V. race_part: grid (RACE_SPLIT, R), the row's 1024
//   threads in RACE_SPLIT blocks, writing partials [R, 1024, 2] fp32 (each thread's OnlineStats) and [R, RACE_SPLIT]
//   (best key fp64, its index int32); race_merge: grid R, 1024 threads (and the min-p rows whole).

#define BLOCK 1024
#define WARPS (BLOCK / 32)
#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))
#define POS_INF (__longlong_as_double(0x7ff0000000000000LL))
#define NEG_INF_F (-__int_as_float(0x7f800000))

__device__ __forceinline__ double warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions over N threads (BLOCK unless said); every thread gets the result. `scratch` holds N / 32
// doubles.
template <int N = BLOCK>
__device__ double block_max(double v, double* scratch) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < N / 32 ? scratch[threadIdx.x] : NEG_INF;
  if (threadIdx.x < 32) v = warp_max(v);
  if (threadIdx.x == 0) scratch[0] = v;
  __syncthreads();
  return scratch[0];
}

__device__ double block_sum(double v, double* scratch) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < WARPS ? scratch[threadIdx.x] : 0.0;
  if (threadIdx.x < 32) v = warp_sum(v);
  if (threadIdx.x == 0) scratch[0] = v;
  __syncthreads();
  return scratch[0];
}

// (score, index) argmax: larger score wins, the smaller index on equal scores (np.argmax).
__device__ __forceinline__ void better(double& s, int& i, double s2, int i2) {
  if (s2 > s || (s2 == s && i2 < i)) { s = s2; i = i2; }
}

// The block's (score, index) argmax: every thread gets the index, and the score in scratch[0].
template <int N = BLOCK>
__device__ int block_argmax(double s, int i, double* scratch, int* iscratch) {
  for (int o = 16; o > 0; o >>= 1) better(s, i, __shfl_xor_sync(0xffffffffu, s, o), __shfl_xor_sync(0xffffffffu, i, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { scratch[threadIdx.x >> 5] = s; iscratch[threadIdx.x >> 5] = i; }
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < N / 32 ? scratch[threadIdx.x] : NEG_INF;
    i = threadIdx.x < N / 32 ? iscratch[threadIdx.x] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) better(s, i, __shfl_xor_sync(0xffffffffu, s, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (threadIdx.x == 0) { scratch[0] = s; iscratch[0] = i; }
  }
  __syncthreads();
  return iscratch[0];
}

// Raw-row statistics for the raw logprob of a token: (max, log(sum(exp(x - max)))) of an fp32 logits row.
// Each thread keeps an online (max, sum) in fp32 over its strided entries, the block combines them in fp64.
// prepare_rows and race both use it, so the eager sampler's top logprobs, its sampled logprob and the
// decode graph's sampled logprob carry the same bits.
struct OnlineStats {
  float m = -3.402823466e38f;  // -FLT_MAX: a -inf entry then adds exp(-inf) = 0, never NaN
  float s = 0.f;
  __device__ __forceinline__ void add(float x) {
    if (x > m) {
      s = s * __expf(m - x) + 1.f;
      m = x;
    } else {
      s += __expf(x - m);
    }
  }
};

// f(x, i) for the entries i = v, v + BLOCK, v + 2 BLOCK, ... of a row of fp32 logits, in that order (so per-thread
// sums are bit for bit those of a plain strided loop), with LOADS loads in flight per thread: one at a time leaves
// the pass waiting on memory latency, not bandwidth. v: the thread's place among the row's BLOCK threads
// (threadIdx.x, or, for a row split over several blocks, see race_part).
constexpr int ROW_LOADS = 4;
// The decode graph's race spreads each row over RACE_SPLIT blocks (race_part) with RACE_ROW_LOADS loads in flight per
// thread: one block of BLOCK threads per row leaves most SMs idle below ~132 rows and runs two blocks' rows one after
// the other above (bench_sampling.py). sampling_launcher keeps a copy of RACE_SPLIT (the partials' size).
constexpr int RACE_SPLIT = 8;
constexpr int RACE_ROW_LOADS = 8;
template <int LOADS = ROW_LOADS, typename F>
__device__ __forceinline__ void for_each_entry(const float* row, int vocab, F&& f, int v = threadIdx.x) {
  for (int i0 = v; i0 < vocab; i0 += LOADS * BLOCK) {
    float x[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) x[j] = i0 + j * BLOCK < vocab ? row[i0 + j * BLOCK] : 0.f;
#pragma unroll
    for (int j = 0; j < LOADS; ++j)
      if (i0 + j * BLOCK < vocab) f(x[j], i0 + j * BLOCK);
  }
}

// Every thread gets (max, log of the normaliser) of the row.
__device__ void block_stats(const OnlineStats& t, double* scratch, double& max_out, double& lse_out) {
  const double m = block_max((double)t.m, scratch);
  const double s = block_sum((double)t.s * exp((double)t.m - m), scratch);
  max_out = m;
  lse_out = log(s);
}

extern "C" __global__ void __launch_bounds__(BLOCK) prepare_rows(const float* logits, const int* rows, double* adjusted, double* raw_stats,
                                        int vocab) {
  __shared__ double scratch[WARPS];
  const float* in = logits + (size_t)rows[blockIdx.x] * vocab;
  double* out = adjusted + (size_t)blockIdx.x * vocab;
  OnlineStats stats;
  for_each_entry(in, vocab, [&](float x, int i) {
    out[i] = (double)x;
    stats.add(x);
  });
  double m, lse;
  block_stats(stats, scratch, m, lse);
  if (threadIdx.x == 0) {
    raw_stats[2 * blockIdx.x] = m;
    raw_stats[2 * blockIdx.x + 1] = lse;
  }
}

extern "C" __global__ void count_tokens(const int* tokens, int* seen, int* counts, int num_tokens, int vocab) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
    const size_t at = (size_t)tokens[3 * t] * vocab + tokens[3 * t + 1];
    seen[at] = 1;
    if (tokens[3 * t + 2]) atomicAdd(counts + at, 1);
  }
}

extern "C" __global__ void apply_penalties(double* adjusted, const int* penalty_rows, const double* penalties,
                                           const int* seen, const int* counts, int vocab) {
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= vocab) return;
  const int slot = blockIdx.y;
  const double rep = penalties[3 * slot], freq = penalties[3 * slot + 1], presence = penalties[3 * slot + 2];
  const size_t at = (size_t)slot * vocab + v;
  double* x = adjusted + (size_t)penalty_rows[slot] * vocab + v;
  double value = *x;
  if (rep != 1.0 && seen[at]) value = value > 0.0 ? __ddiv_rn(value, rep) : __dmul_rn(value, rep);
  if (freq != 0.0 || presence != 0.0) {
    const int count = counts[at];
    value = __dsub_rn(value, __dadd_rn(__dmul_rn(freq, (double)count), __dmul_rn(presence, count > 0 ? 1.0 : 0.0)));
  }
  *x = value;
}

extern "C" __global__ void ban_tokens(double* adjusted, const int* pairs, int num_pairs, int vocab) {
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < num_pairs; q += gridDim.x * blockDim.x) {
    adjusted[(size_t)pairs[2 * q] * vocab + pairs[2 * q + 1]] = NEG_INF;
  }
}

// Monotone map of a double onto uint64 (x < y  <=>  key(x) < key(y) for non-NaN, -0.0 just below +0.0).
__device__ __forceinline__ unsigned long long order_key(double x) {
  const unsigned long long u = (unsigned long long)__double_as_longlong(x);
  return (u >> 63) ? ~u : (u | 0x8000000000000000ULL);
}

__device__ __forceinline__ double key_value(unsigned long long k) {
  return __longlong_as_double((long long)((k >> 63) ? (k & 0x7fffffffffffffffULL) : ~k));
}

// Entry i of row r as float64: the adjusted row (eager sampler, after penalties and bans) or the raw logits
// row rows[r] converted (the decode graph's sampler: no penalties or bans there, so the two agree).
template <bool FROM_LOGITS>
__device__ __forceinline__ double entry(const double* a, const float* raw, int i) {
  return FROM_LOGITS ? (double)raw[i] : a[i];
}

// Whether a row's packed mask (`mask`: its W words; llguidance's layout) allows token i; tokens past 32 W never.
__device__ __forceinline__ bool allowed(const int* mask, int words, int i) {
  const int w = i >> 5;
  return w < words && ((static_cast<unsigned>(mask[w]) >> (i & 31)) & 1u);
}

// Entry i as the eager sampler sees it after apply_token_bitmask (MASKED) or as entry() (not MASKED).
template <bool FROM_LOGITS, bool MASKED>
__device__ __forceinline__ double masked_entry(const double* a, const float* raw, const int* mask, int words, int i) {
  return MASKED && !allowed(mask, words, i) ? NEG_INF : entry<FROM_LOGITS>(a, raw, i);
}

template <bool FROM_LOGITS, bool MASKED = false>
__device__ void top_cut_impl(const double* adjusted, const float* logits, const int* rows, const double* params,
                             double* cut, int vocab, const int* bitmask = nullptr, int words = 0) {
  __shared__ double scratch[WARPS];
  const int r = blockIdx.x;
  const double temperature = params[8 * r], top_p = params[8 * r + 3];
  const int top_k = (int)params[8 * r + 4];
  const bool has_k = top_k > 0 && top_k < vocab;
  if (params[8 * r + 2] != 0.0 || !(has_k || top_p < 1.0)) {  // greedy, or nothing to cut: uniform exit
    if (threadIdx.x == 0) cut[r] = NEG_INF;
    return;
  }
  const double* a = FROM_LOGITS ? nullptr : adjusted + (size_t)r * vocab;
  const float* raw = FROM_LOGITS ? logits + (size_t)rows[r] * vocab : nullptr;
  const int* mask = MASKED ? bitmask + (size_t)r * words : nullptr;
  auto value = [&](int i) { return masked_entry<FROM_LOGITS, MASKED>(a, raw, mask, words, i); };
  // top-k: the largest key with at least k entries >= it is the key of the k-th largest adjusted value
  // (ties kept); dividing by temperature > 0 keeps the order, so kth = that value / temperature.
  double kth = NEG_INF;
  if (has_k) {
    unsigned long long prefix = 0;
    for (int bit = 63; bit >= 0; --bit) {
      const unsigned long long candidate = prefix | (1ULL << bit);
      double n = 0.0;
      for (int i = threadIdx.x; i < vocab; i += BLOCK) n += order_key(value(i)) >= candidate ? 1.0 : 0.0;
      if (block_sum(n, scratch) >= (double)top_k) prefix = candidate;
    }
    kth = __ddiv_rn(key_value(prefix), temperature);
  }
  double result = kth;
  if (top_p < 1.0) {
    double m = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(value(i), temperature);
      if (x >= kth) m = fmax(m, x);
    }
    m = block_max(m, scratch);
    double s = 0.0;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(value(i), temperature);
      if (x >= kth) s = __dadd_rn(s, exp(__dsub_rn(x, m)));
    }
    const double lse = log(block_sum(s, scratch));
    // H(t) = mass of the survivors with key >= t. The kept set is every value v whose mass strictly
    // above it is < top_p: the cut is the largest key t with H(t) >= top_p (if the whole mass reaches it).
    unsigned long long prefix = 0;
    for (int bit = 64; bit >= 0; --bit) {  // bit 64: H(0), the whole mass
      const unsigned long long candidate = bit == 64 ? 0ULL : prefix | (1ULL << bit);
      double h = 0.0;
      for (int i = threadIdx.x; i < vocab; i += BLOCK) {
        const double x = __ddiv_rn(value(i), temperature);
        if (x >= kth && order_key(x) >= candidate) h = __dadd_rn(h, exp(__dsub_rn(__dsub_rn(x, m), lse)));
      }
      const bool reached = block_sum(h, scratch) >= top_p;
      if (bit == 64 && !reached) break;  // rounding left the mass below top_p: keep every survivor
      if (bit < 64 && reached) prefix = candidate;
      if (bit == 0) result = fmax(kth, key_value(prefix));
    }
  }
  if (threadIdx.x == 0) cut[r] = result;
}

extern "C" __global__ void apply_token_bitmask(double* adjusted, const int* mask_rows, const int* bitmask,
                                               int words, int vocab) {
  const int slot = blockIdx.y;
  const int v = blockIdx.x * 256 + threadIdx.x;
  if (v >= vocab) return;
  const int w = v >> 5;
  const bool allowed =
      w < words && ((static_cast<unsigned>(bitmask[static_cast<long long>(slot) * words + w]) >> (v & 31)) & 1u);
  if (!allowed) adjusted[static_cast<long long>(mask_rows[slot]) * vocab + v] = NEG_INF;
}

extern "C" __global__ void __launch_bounds__(BLOCK) top_cut(const double* adjusted, const double* params, double* cut,
                                                          int vocab) {
  top_cut_impl<false>(adjusted, nullptr, nullptr, params, cut, vocab);
}

extern "C" __global__ void __launch_bounds__(BLOCK) top_cut_logits(const float* logits, const int* rows,
                                                                 const double* params, double* cut, int vocab) {
  top_cut_impl<true>(nullptr, logits, rows, params, cut, vocab);
}

extern "C" __global__ void __launch_bounds__(BLOCK) top_cut_logits_masked(const float* logits, const int* rows,
                                                                        const int* bitmask, int words,
                                                                        const double* params, double* cut,
                                                                        int vocab) {
  top_cut_impl<true, true>(nullptr, logits, rows, params, cut, vocab, bitmask, words);
}

// Graph sampling: each bucket slot's sampling inputs from the persistent per-row buffers.
extern "C" __global__ void gather_row_params(const int* slot_rows, const int* sample_positions,
                                             const double* row_params, const unsigned long long* row_seeds,
                                             double* params, unsigned long long* seeds,
                                             unsigned long long* positions, int num_slots) {
  const int slot = blockIdx.x * blockDim.x + threadIdx.x;
  if (slot >= num_slots) return;
  const int row = slot_rows[slot];
  for (int j = 0; j < 8; ++j) params[8 * slot + j] = row >= 0 ? row_params[8 * (size_t)row + j] : (j == 2 ? 1.0 : 0.0);
  seeds[slot] = row >= 0 ? row_seeds[row] : 0ULL;
  positions[slot] = row >= 0 ? (unsigned long long)sample_positions[slot] : 0ULL;
}

// out [R, 2] fp64 (token id, logprob) -> token_ids [R] int32 (the next step's input ids).
extern "C" __global__ void chosen_ids(const double* out, int* token_ids, int num_rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < num_rows) token_ids[r] = (int)out[2 * r];
}

// The random stream of random_stream.py: element i of row (seed, position) hashes
// stream_base(seed, position) + i with the splitmix64 finaliser; u = (bits + 0.5) * 2^-53.
__device__ __forceinline__ unsigned long long stream_base(unsigned long long seed, unsigned long long position) {
  return seed * 0x9E3779B97F4A7C15ULL + position * 0xBF58476D1CE4E5B9ULL;
}

// 53 random bits of element i.
__device__ __forceinline__ unsigned long long stream_bits(unsigned long long base, unsigned long long i) {
  unsigned long long x = base + i;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x >> 11;
}

__device__ __forceinline__ double uniform(unsigned long long base, unsigned long long i) {
  return __dmul_rn(__dadd_rn((double)stream_bits(base, i), 0.5), 1.1102230246251565e-16);  // 2^-53
}

// log(-log(u)) in fp32 for u = (bits + 0.5) * 2^-53, to a few 1e-4 absolute at worst (u close to 1, where
// -log(u) ~ 1 - u is taken from the exact integer 2^53 - bits instead of from a rounded u).
__device__ __forceinline__ float log_exponential(unsigned long long bits) {
  const float u = ((float)bits + 0.5f) * 1.1102230246251565e-16f;
  const float one_minus_u = ((float)((1ULL << 53) - bits) - 0.5f) * 1.1102230246251565e-16f;
  float e;
  if (one_minus_u > 1e-3f) {
    e = -__logf(u);
  } else {  // -log(1 - w) = w + w^2/2 + w^3/3 + ..., w <= 1e-3: the rest is below 1e-9 relative
    e = one_minus_u * (1.f + one_minus_u * (0.5f + one_minus_u * (1.f / 3.f)));
  }
  return __logf(e);
}

// The race's key in float64, argmax-equivalent to NumPy's p_i / (-log u_i): log p_i differs from the scaled
// logit x_i by the row's log-normaliser, the same for every i.
__device__ __forceinline__ double exact_key(double x, unsigned long long base, int i) {
  return x - log(-log(uniform(base, (unsigned long long)i)));
}

// One sampled row per block (SPLIT = 1) or per SPLIT blocks (race_part). Greedy rows take the argmax; min-p rows
// run the exact race in float64 over every entry; other rows run it through an fp32 filter:
//   score_i = y_i - log(-log u_i) in fp32 (y = x / T) for the kept entries (x / T >= cut), each thread
//   keeping its best two. With M the block's best score and `band` larger than twice the fp32 error, every
//   entry whose exact key can beat the exact winner has score >= M - band. A thread whose second best is below
//   M - band holds at most one such entry, its best, which gets the exact float64 key; a thread with two or more
//   (rare) scores its entries again and takes the exact key of every one within 2 band (a margin for the second
//   pass's fp32 rounding). Either way the token is the exact race's: argmax of the float64 key, the smaller index
//   on equal keys.
// Also the raw row's (max, lse) (OnlineStats, as prepare_rows) for the sampled token's raw logprob.
// SPLIT > 1: the row's BLOCK threads are spread over SPLIT blocks of BLOCK / SPLIT (grid x = part, y = row), so
// that a few rows still fill the GPU; thread v of the row (v = part * BLOCK / SPLIT + threadIdx.x) walks the same
// entries as thread v of one block would. Each part applies the filter to its own entries with its own M: an entry
// that can win has score >= the row's M - band >= the part's M - band, so the part's exact candidates include
// every row-wide one. A part writes its threads' OnlineStats and its best (key, index) to Partials; race_merge
// combines them (and runs min-p rows, which need the whole row's softmax, with SPLIT = 1).
struct Partials {
  float* stats;  // [R, BLOCK, 2]: each thread's OnlineStats (m, s)
  double* key;   // [R, SPLIT]: each part's best exact key (or value, greedy rows)
  int* index;    // [R, SPLIT]: and its index
};

template <bool FROM_LOGITS, bool MASKED = false, int SPLIT = 1>
__device__ void race_impl(const double* adjusted, const double* cut, const float* logits, const int* rows,
                          const double* params, const unsigned long long* seeds,
                          const unsigned long long* positions, double* out, int vocab,
                          const int* bitmask = nullptr, int words = 0, Partials part = {}) {
  constexpr int N = BLOCK / SPLIT;  // threads of this block
  constexpr int LOADS = SPLIT > 1 ? RACE_ROW_LOADS : ROW_LOADS;
  __shared__ double scratch[N / 32];
  __shared__ int iscratch[N / 32];
  const int r = SPLIT > 1 ? blockIdx.y : blockIdx.x;
  const int v = SPLIT > 1 ? blockIdx.x * N + threadIdx.x : threadIdx.x;  // this thread's place in the row
  const double* a = FROM_LOGITS ? nullptr : adjusted + (size_t)r * vocab;
  const float* raw = logits + (size_t)rows[r] * vocab;
  const int* mask = MASKED ? bitmask + (size_t)r * words : nullptr;
  auto value = [&](int i) { return masked_entry<FROM_LOGITS, MASKED>(a, raw, mask, words, i); };
  const double temperature = params[8 * r], min_p = params[8 * r + 1];
  const bool greedy = params[8 * r + 2] != 0.0;
  const unsigned long long base = stream_base(seeds[r], positions[r]);
  OnlineStats stats;
  double best = NEG_INF;
  int best_i = 0x7fffffff;
  if (greedy) {
    for_each_entry<LOADS>(raw, vocab, [&](float raw_x, int i) {
      stats.add(raw_x);
      better(best, best_i, MASKED && !allowed(mask, words, i) ? NEG_INF : (FROM_LOGITS ? (double)raw_x : a[i]), i);
    }, v);
  } else if (min_p > 0.0) {
    if constexpr (SPLIT > 1) return;  // (the whole block) race_merge runs the row
    for_each_entry(raw, vocab, [&](float raw_x, int) { stats.add(raw_x); });
    const double c = cut[r];
    // max and normaliser of the survivors of top-k / top-p (x >= c; -inf never survives)
    double m = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(value(i), temperature);
      if (x >= c) m = fmax(m, x);
    }
    m = block_max(m, scratch);
    double s = 0.0;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(value(i), temperature);
      if (x >= c) s = __dadd_rn(s, exp(__dsub_rn(x, m)));
    }
    const double lse = log(block_sum(s, scratch));
    // min-p: keep p >= min_p * max p, max p = exp(0 - lse); then renormalise
    const double floor_p = __dmul_rn(min_p, exp(__dsub_rn(0.0, lse)));
    s = 0.0;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(value(i), temperature);
      if (x >= c && exp(__dsub_rn(__dsub_rn(x, m), lse)) >= floor_p) s = __dadd_rn(s, exp(__dsub_rn(x, m)));
    }
    const double lse2 = log(block_sum(s, scratch));
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(value(i), temperature);
      const bool kept = x >= c && exp(__dsub_rn(__dsub_rn(x, m), lse)) >= floor_p;
      const double p = kept ? exp(__dsub_rn(__dsub_rn(x, m), lse2)) : 0.0;
      if (p > 0.0) {
        const double score = __ddiv_rn(p, __dsub_rn(0.0, log(uniform(base, i))));
        better(best, best_i, score, i);
      }
    }
  } else {
    const double c = cut[r];
    const float inv_t = (float)(1.0 / temperature), c32 = (float)c;
    const float margin = 1e-6f * fabsf(c32);  // around the cut, fp32 cannot decide: ask float64
    // The fp32 filter's score of entry i, -inf where the cut or the mask drops it.
    auto score_of = [&](float raw_x, int i) -> float {
      const float y = MASKED && !allowed(mask, words, i) ? NEG_INF_F : (FROM_LOGITS ? raw_x : (float)a[i]) * inv_t;
      if (!(y >= c32 - margin)) return NEG_INF_F;  // surely cut (or -inf / NaN)
      if (y <= c32 + margin && !(__ddiv_rn(value(i), temperature) >= c)) return NEG_INF_F;
      return y - log_exponential(stream_bits(base, (unsigned long long)i));
    };
    float s1 = NEG_INF_F, s2 = NEG_INF_F;
    int i1 = -1;
    for_each_entry<LOADS>(raw, vocab, [&](float raw_x, int i) {
      stats.add(raw_x);
      const float score = score_of(raw_x, i);
      if (score > s1) {
        s2 = s1;
        s1 = score;
        i1 = i;
      } else if (score > s2) {
        s2 = score;
      }
    }, v);
    const double top = block_max<N>((double)s1, scratch);
    const double band = 1e-2 + 1e-6 * (fabs(top) + 64.0);
    if (s2 >= top - band) {  // (rare) two or more of this thread's entries may win: score them all again
      for (int i = v; i < vocab; i += BLOCK) {
        const float score = score_of(raw[i], i);  // (a part of a row may keep no entry: top = -inf)
        if (score > NEG_INF_F && score >= top - 2.0 * band) {
          const double x = __ddiv_rn(value(i), temperature);
          better(best, best_i, exact_key(x, base, i), i);
        }
      }
    } else if (i1 >= 0 && s1 >= top - band) {
      const double x = __ddiv_rn(value(i1), temperature);
      better(best, best_i, exact_key(x, base, i1), i1);
    }
  }
  if constexpr (SPLIT > 1) {
    float* mine = part.stats + ((size_t)r * BLOCK + v) * 2;
    mine[0] = stats.m;
    mine[1] = stats.s;
    const int i = block_argmax<N>(best, best_i, scratch, iscratch);
    if (threadIdx.x == 0) {
      part.key[(size_t)r * SPLIT + blockIdx.x] = scratch[0];
      part.index[(size_t)r * SPLIT + blockIdx.x] = i;
    }
    return;
  }
  double raw_max, raw_lse;
  block_stats(stats, scratch, raw_max, raw_lse);
  const int token = block_argmax(best, best_i, scratch, iscratch);
  if (threadIdx.x == 0) {
    const int safe = token < vocab ? token : 0;  // no kept token at all cannot happen (the max survives)
    out[2 * r] = (double)safe;
    out[2 * r + 1] = __dsub_rn(__dsub_rn((double)raw[safe], raw_max), raw_lse);
  }
}

// The second half of a split race (one block of BLOCK threads per row): the row's (max, lse) from its threads'
// OnlineStats, in block_stats' order (the bits prepare_rows and race give), and the argmax of the parts' bests.
// Min-p rows, which race_part left alone, run here whole.
template <bool MASKED>
__device__ void race_merge_impl(const double* cut, const float* logits, const int* rows, const double* params,
                                const unsigned long long* seeds, const unsigned long long* positions, double* out,
                                int vocab, const int* bitmask, int words, Partials part) {
  __shared__ double scratch[WARPS];
  __shared__ int iscratch[WARPS];
  const int r = blockIdx.x;
  if (params[8 * r + 2] == 0.0 && params[8 * r + 1] > 0.0) {
    race_impl<true, MASKED>(nullptr, cut, logits, rows, params, seeds, positions, out, vocab, bitmask, words);
    return;
  }
  const float* mine = part.stats + ((size_t)r * BLOCK + threadIdx.x) * 2;
  OnlineStats stats;
  stats.m = mine[0];
  stats.s = mine[1];
  double raw_max, raw_lse;
  block_stats(stats, scratch, raw_max, raw_lse);
  const bool has_part = threadIdx.x < RACE_SPLIT;
  const int token = block_argmax(has_part ? part.key[(size_t)r * RACE_SPLIT + threadIdx.x] : NEG_INF,
                                 has_part ? part.index[(size_t)r * RACE_SPLIT + threadIdx.x] : 0x7fffffff, scratch,
                                 iscratch);
  if (threadIdx.x == 0) {
    const float* raw = logits + (size_t)rows[r] * vocab;
    const int safe = token < vocab ? token : 0;
    out[2 * r] = (double)safe;
    out[2 * r + 1] = __dsub_rn(__dsub_rn((double)raw[safe], raw_max), raw_lse);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK) race(const double* adjusted, const double* cut, const float* logits,
                                                       const int* rows, const double* params,
                                                       const unsigned long long* seeds,
                                                       const unsigned long long* positions, double* out, int vocab) {
  race_impl<false>(adjusted, cut, logits, rows, params, seeds, positions, out, vocab);
}

// race_logits (the decode graph's sampler) in two launches: race_part (grid (RACE_SPLIT, R), BLOCK / RACE_SPLIT
// threads) then race_merge (grid R, BLOCK threads), with Partials from the launcher; _masked with bitmask [R, W].
extern "C" __global__ void __launch_bounds__(BLOCK / RACE_SPLIT) race_part(
    const double* cut, const float* logits, const int* rows, const double* params, const unsigned long long* seeds,
    const unsigned long long* positions, float* part_stats, double* part_key, int* part_index, int vocab) {
  race_impl<true, false, RACE_SPLIT>(nullptr, cut, logits, rows, params, seeds, positions, nullptr, vocab, nullptr, 0,
                                     Partials{part_stats, part_key, part_index});
}

extern "C" __global__ void __launch_bounds__(BLOCK / RACE_SPLIT) race_part_masked(
    const double* cut, const float* logits, const int* rows, const int* bitmask, int words, const double* params,
    const unsigned long long* seeds, const unsigned long long* positions, float* part_stats, double* part_key,
    int* part_index, int vocab) {
  race_impl<true, true, RACE_SPLIT>(nullptr, cut, logits, rows, params, seeds, positions, nullptr, vocab, bitmask,
                                    words, Partials{part_stats, part_key, part_index});
}

extern "C" __global__ void __launch_bounds__(BLOCK) race_merge(
    const double* cut, const float* logits, const int* rows, const double* params, const unsigned long long* seeds,
    const unsigned long long* positions, const float* part_stats, const double* part_key, const int* part_index,
    double* out, int vocab) {
  race_merge_impl<false>(cut, logits, rows, params, seeds, positions, out, vocab, nullptr, 0,
                         Partials{const_cast<float*>(part_stats), const_cast<double*>(part_key),
                                  const_cast<int*>(part_index)});
}

extern "C" __global__ void __launch_bounds__(BLOCK) race_merge_masked(
    const double* cut, const float* logits, const int* rows, const int* bitmask, int words, const double* params,
    const unsigned long long* seeds, const unsigned long long* positions, const float* part_stats,
    const double* part_key, const int* part_index, double* out, int vocab) {
  race_merge_impl<true>(cut, logits, rows, params, seeds, positions, out, vocab, bitmask, words,
                        Partials{const_cast<float*>(part_stats), const_cast<double*>(part_key),
                                 const_cast<int*>(part_index)});
}
