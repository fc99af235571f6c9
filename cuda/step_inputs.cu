// Decode-step inputs built on the device from the persistent rows (offline_paged/worker/block_table_rows.py mirrored),
// so a steady decode step uploads a few ints per sequence instead of its whole block table.
// Legend: R persistent rows, Mr their width, b bucket slots, M the bucket's table width, B block size, n changes.
//
// scatter_table_entries
//   changes [n, 3] int32 (row, column, block id); row_tables [R, Mr] int32 (in place). One thread per change.
//
// decode_inputs (slot i of a decode bucket computes one token of the sequence in persistent row slot_rows[i])
//   slot_rows [b] int32 (-1: padding); positions [b] int32; writes [b] int32 (0: the token's K/V is cached,
//   not rewritten); row_tables [R, Mr] int32
//   slot_mapping [b] int32 (out): row_tables[row, p / B] * B + p % B, or -1 (padding or no write)
//   context_lens [b] int32 (out): p + 1 (1 for padding); query_start_loc [b + 1] int32 (out): 0..b
//   block_tables [b, M] int32 (out): the first ceil((p + 1) / B) entries of the row, zeros after
//   (padding rows all zeros: they read block 0 slot 0, and their logits are never used).
//   Grid: x = slot; block: 128 threads striding over M.
//
// launch_order
//   context_lens [n] int32; order [n] int32 (out): the sequence indices by context length, longest first,
//   ties in index order (a permutation of 0..n-1). Attention runs sequence order[z] as its z-th grid slice:
//   the hardware hands CTAs out in launch order, so the longest sequences start first and the last wave
//   holds short ones instead of a random mix that leaves SMs idle behind the longest (a 3.9-wave decode
//   grid). Thread i counts the sequences ranked before it, O(n^2) over shared-memory tiles (n <= a few
//   hundred: microseconds). Grid: x = ceil(n / 256); block: 256 threads.

extern "C" __global__ void scatter_table_entries(const int* changes, int* row_tables, int num_changes, int row_width) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= num_changes) return;
  row_tables[(size_t)changes[3 * c] * row_width + changes[3 * c + 1]] = changes[3 * c + 2];
}

extern "C" __global__ void decode_inputs(const int* slot_rows, const int* positions, const int* writes,
                                         const int* row_tables, int row_width, int* slot_mapping,
                                         int* context_lens, int* query_start_loc, int* block_tables,
                                         int width, int block_size, int num_slots) {
  const int slot = blockIdx.x;
  const int row = slot_rows[slot];
  const int p = row >= 0 ? positions[slot] : 0;
  const int used = row >= 0 ? min(p / block_size + 1, min(width, row_width)) : 0;
  const int* source = row_tables + (size_t)(row >= 0 ? row : 0) * row_width;
  int* table = block_tables + (size_t)slot * width;
  for (int j = threadIdx.x; j < width; j += blockDim.x) table[j] = j < used ? source[j] : 0;
  if (threadIdx.x == 0) {
    slot_mapping[slot] = row >= 0 && writes[slot] ? source[p / block_size] * block_size + p % block_size : -1;
    context_lens[slot] = p + 1;
    query_start_loc[slot] = slot;
    if (slot == num_slots - 1) query_start_loc[num_slots] = num_slots;
  }
}

extern "C" __global__ void launch_order(const int* context_lens, int* order, int n) {
  constexpr int TILE = 256;
  __shared__ int tile[TILE];
  const int i = blockIdx.x * TILE + threadIdx.x;
  const int mine = i < n ? context_lens[i] : 0;
  int rank = 0;
  for (int base = 0; base < n; base += TILE) {
    __syncthreads();  // the previous tile is read by every thread
    if (base + threadIdx.x < n) tile[threadIdx.x] = context_lens[base + threadIdx.x];
    __syncthreads();
    const int count = min(TILE, n - base);
    for (int k = 0; k < count; ++k) {
      const int other = tile[k];
      rank += other > mine || (other == mine && base + k < i);
    }
  }
  if (i < n) order[rank] = i;
}
