// Sampling on the GPU: the NumPy sampler (offline_paged/sampler.py) in float64, so only the sampled ids and
// the requested log-probabilities cross to the host. Legend: R sampled rows, K logits rows, V vocab,
// Rp rows with penalties, Rs rows with top-k or top-p, P penalty tokens, Q banned (row, token) pairs.
// Every kernel is compiled without FMA contraction in the places where NumPy rounds twice (explicit __d*_rn).
//
// prepare_rows
//   logits [K, V] fp32 contiguous; rows [R] int32 (row of logits each sampled row reads)
//   adjusted [R, V] fp64 (out): the row as float64, to be penalised / banned in place
//   raw_stats [R, 2] fp64 (out): (max, log(sum(exp(x - max)))) of the raw row: logprob = (x - max) - lse
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
// top_cut (rows with top-k or top-p; the threshold the race keeps x >= cut by)
//   sorted [Rs, V] fp64: each selected row of adjusted sorted ascending; cut_rows [Rs] int32 (its row)
//   params [R, 8] fp64 (see race); cut [R] fp64 (out, written for the selected rows only)
//   x_j = sorted_j / temperature. top-k: kth = x_{V-k} (ties kept); top-p on the survivors, NumPy's rule:
//   p_j = exp((x_j - max) - log S) in descending order, mass_before_j = cumsum_j - p_j, n = #(mass_before < p),
//   keep p >= p_(max(n,1)-1). Grid: x = selected row; block: 1024 threads, chunked block scan of the descent.
//
// race
//   adjusted [R, V] fp64; cut [R] fp64 (-inf: no top-k / top-p); raw_stats [R, 2] fp64; logits, rows as above
//   params [R, 8] fp64: (temperature, min_p, greedy flag, unused...) ; seeds [R] uint64; positions [R] uint64
//   out [R, 2] fp64 (out): (token id, raw logprob of that token)
//   greedy: argmax of adjusted (first index on ties). Otherwise x = adjusted / T, kept = x >= cut and
//   p > 0, min-p on the renormalised survivors, then argmax_i p_i / (0 - log u_i) with
//   u_i = ((splitmix64(seed * A + position * B + i) >> 11) + 0.5) * 2^-53 (random_stream.py).
//   Grid: x = sampled row; block: 1024 threads striding over V.

#define BLOCK 1024
#define WARPS (BLOCK / 32)
#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))
#define POS_INF (__longlong_as_double(0x7ff0000000000000LL))

__device__ __forceinline__ double warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions over BLOCK threads; every thread gets the result. `scratch` holds WARPS doubles.
__device__ double block_max(double v, double* scratch) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < WARPS ? scratch[threadIdx.x] : NEG_INF;
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

__device__ int block_argmax(double s, int i, double* scratch, int* iscratch) {
  for (int o = 16; o > 0; o >>= 1) better(s, i, __shfl_xor_sync(0xffffffffu, s, o), __shfl_xor_sync(0xffffffffu, i, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { scratch[threadIdx.x >> 5] = s; iscratch[threadIdx.x >> 5] = i; }
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < WARPS ? scratch[threadIdx.x] : NEG_INF;
    i = threadIdx.x < WARPS ? iscratch[threadIdx.x] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) better(s, i, __shfl_xor_sync(0xffffffffu, s, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (threadIdx.x == 0) iscratch[0] = i;
  }
  __syncthreads();
  return iscratch[0];
}

extern "C" __global__ void __launch_bounds__(BLOCK) prepare_rows(const float* logits, const int* rows, double* adjusted, double* raw_stats,
                                        int vocab) {
  __shared__ double scratch[WARPS];
  const float* in = logits + (size_t)rows[blockIdx.x] * vocab;
  double* out = adjusted + (size_t)blockIdx.x * vocab;
  double m = NEG_INF;
  for (int i = threadIdx.x; i < vocab; i += BLOCK) {
    const double x = (double)in[i];
    out[i] = x;
    m = fmax(m, x);
  }
  m = block_max(m, scratch);
  double s = 0.0;
  for (int i = threadIdx.x; i < vocab; i += BLOCK) s = __dadd_rn(s, exp(__dsub_rn((double)in[i], m)));
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    raw_stats[2 * blockIdx.x] = m;
    raw_stats[2 * blockIdx.x + 1] = log(s);
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

// Inclusive block scan of one value per thread (Hillis-Steele over warps, then over warp totals).
__device__ double block_inclusive_scan(double v, double* scratch, double& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v = __dadd_rn(v, n);
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double w = lane < WARPS ? scratch[lane] : 0.0;
    for (int o = 1; o < 32; o <<= 1) {
      const double n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w = __dadd_rn(w, n);
    }
    if (lane < WARPS) scratch[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = __dadd_rn(v, scratch[warp - 1]);
  total = scratch[WARPS - 1];
  return v;
}

extern "C" __global__ void __launch_bounds__(BLOCK) top_cut(const double* sorted, const int* cut_rows, const double* params, double* cut,
                                   int vocab) {
  __shared__ double scratch[WARPS];
  const int row = cut_rows[blockIdx.x];
  const double* x = sorted + (size_t)blockIdx.x * vocab;
  const double temperature = params[8 * row], top_p = params[8 * row + 3];
  const int top_k = (int)params[8 * row + 4];
  double kth = NEG_INF;
  if (top_k > 0 && top_k < vocab) kth = __ddiv_rn(x[vocab - top_k], temperature);
  // survivors of top-k: indices lo..vocab-1 of the ascending row (ties with kth included)
  double below = 0.0;
  for (int j = threadIdx.x; j < vocab; j += BLOCK) below += __ddiv_rn(x[j], temperature) < kth ? 1.0 : 0.0;
  const int lo = (int)block_sum(below, scratch);
  double result = kth;
  if (top_p < 1.0) {
    const double m = __ddiv_rn(x[vocab - 1], temperature);
    double s = 0.0;
    for (int j = lo + threadIdx.x; j < vocab; j += BLOCK) s = __dadd_rn(s, exp(__dsub_rn(__ddiv_rn(x[j], temperature), m)));
    const double lse = log(block_sum(s, scratch));
    // descending walk d = 0, 1, ... over j = vocab-1-d; chunked scan; count mass_before < top_p
    const int num = vocab - lo;
    double carry = 0.0, kept = 0.0;
    for (int base = 0; base < num; base += BLOCK) {
      const int d = base + threadIdx.x;
      const double p = d < num ? exp(__dsub_rn(__dsub_rn(__ddiv_rn(x[vocab - 1 - d], temperature), m), lse)) : 0.0;
      double total;
      const double inclusive = __dadd_rn(carry, block_inclusive_scan(p, scratch, total));
      if (d < num && __dsub_rn(inclusive, p) < top_p) kept += 1.0;
      carry = __dadd_rn(carry, total);
      __syncthreads();
    }
    const int num_kept = max((int)block_sum(kept, scratch), 1);
    const double smallest = exp(__dsub_rn(__dsub_rn(__ddiv_rn(x[vocab - num_kept], temperature), m), lse));
    // every survivor whose probability rounds to >= smallest stays (NumPy compares probabilities)
    double count = 0.0;
    for (int j = lo + threadIdx.x; j < vocab; j += BLOCK) {
      count += exp(__dsub_rn(__dsub_rn(__ddiv_rn(x[j], temperature), m), lse)) >= smallest ? 1.0 : 0.0;
    }
    const int total_kept = (int)block_sum(count, scratch);
    result = fmax(kth, __ddiv_rn(x[vocab - total_kept], temperature));
  }
  if (threadIdx.x == 0) cut[row] = result;
}

__device__ __forceinline__ double uniform(unsigned long long seed, unsigned long long position, unsigned long long i) {
  unsigned long long x = seed * 0x9E3779B97F4A7C15ULL + position * 0xBF58476D1CE4E5B9ULL + i;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return __dmul_rn(__dadd_rn((double)(x >> 11), 0.5), 1.1102230246251565e-16);  // 2^-53
}

extern "C" __global__ void __launch_bounds__(BLOCK) race(const double* adjusted, const double* cut, const double* raw_stats, const float* logits,
                                const int* rows, const double* params, const unsigned long long* seeds,
                                const unsigned long long* positions, double* out, int vocab) {
  __shared__ double scratch[WARPS];
  __shared__ int iscratch[WARPS];
  const int r = blockIdx.x;
  const double* a = adjusted + (size_t)r * vocab;
  const double temperature = params[8 * r], min_p = params[8 * r + 1];
  const bool greedy = params[8 * r + 2] != 0.0;
  double best = NEG_INF;
  int best_i = 0x7fffffff;
  if (greedy) {
    for (int i = threadIdx.x; i < vocab; i += BLOCK) better(best, best_i, a[i], i);
  } else {
    const double c = cut[r];
    // max and normaliser of the survivors of top-k / top-p (x >= c; -inf never survives)
    double m = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(a[i], temperature);
      if (x >= c) m = fmax(m, x);
    }
    m = block_max(m, scratch);
    double s = 0.0;
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
      const double x = __ddiv_rn(a[i], temperature);
      if (x >= c) s = __dadd_rn(s, exp(__dsub_rn(x, m)));
    }
    double lse = log(block_sum(s, scratch));
    double floor_p = 0.0;  // min-p: keep p >= min_p * max p, max p = exp(0 - lse); then renormalise
    if (min_p > 0.0) {
      floor_p = __dmul_rn(min_p, exp(__dsub_rn(0.0, lse)));
      s = 0.0;
      for (int i = threadIdx.x; i < vocab; i += BLOCK) {
        const double x = __ddiv_rn(a[i], temperature);
        if (x >= c && exp(__dsub_rn(__dsub_rn(x, m), lse)) >= floor_p) s = __dadd_rn(s, exp(__dsub_rn(x, m)));
      }
      const double lse2 = log(block_sum(s, scratch));
      for (int i = threadIdx.x; i < vocab; i += BLOCK) {
        const double x = __ddiv_rn(a[i], temperature);
        const bool kept = x >= c && exp(__dsub_rn(__dsub_rn(x, m), lse)) >= floor_p;
        const double p = kept ? exp(__dsub_rn(__dsub_rn(x, m), lse2)) : 0.0;
        if (p > 0.0) {
          const double score = __ddiv_rn(p, __dsub_rn(0.0, log(uniform(seeds[r], positions[r], i))));
          better(best, best_i, score, i);
        }
      }
    } else {
      for (int i = threadIdx.x; i < vocab; i += BLOCK) {
        const double x = __ddiv_rn(a[i], temperature);
        const double p = x >= c ? exp(__dsub_rn(__dsub_rn(x, m), lse)) : 0.0;
        if (p > 0.0) {
          const double score = __ddiv_rn(p, __dsub_rn(0.0, log(uniform(seeds[r], positions[r], i))));
          better(best, best_i, score, i);
        }
      }
    }
  }
  const int token = block_argmax(best, best_i, scratch, iscratch);
  if (threadIdx.x == 0) {
    const int safe = token < vocab ? token : 0;  // no kept token at all cannot happen (the max survives)
    const double x = (double)logits[(size_t)rows[r] * vocab + safe];
    out[2 * r] = (double)safe;
    out[2 * r + 1] = __dsub_rn(__dsub_rn(x, raw_stats[2 * r]), raw_stats[2 * r + 1]);
  }
}
