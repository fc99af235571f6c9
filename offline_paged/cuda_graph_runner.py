"""DecodeGraphs: decode-only steps (one new token per sequence) replayed from CUDA graphs, one per bucket.

Legend: S sequences in the step, b bucket size (S rounded up), M max blocks per sequence
(ceil(max_model_len / B)), B block size, E hidden size, V vocab, L layers.

Per bucket b one packed int32 device buffer holds the step's inputs at fixed addresses:
    [input ids b | positions b | slot mapping b | context lens b | query_start_loc b + 1 |
     slot rows b | sample positions b | block tables b*M]
A step packs them on the host, copies them over in one H2D copy and launches the graph captured for b.
Rows S..b are padding: token 0 at position 0, slot -1 (no KV write), context len 1 reading block 0 slot 0
(whatever is there; their logits are never read), slot row -1.

Sampling inside the graph (`run_and_sample`): a second graph per bucket, captured on its first use, samples
every slot of the bucket's logits with the eager GpuSampler's own kernels (prepare_rows -> top_cut -> race,
cuda/sampling.cu) after gathering each slot's (params, seed, output position) from persistent row buffers
[Rp, 8] float64 / [Rp] uint64 that are written only when a row gets a new sequence (SamplingRows). The
random stream is a function of (seed, output position) read from device buffers, so a replay draws what the
eager sampler draws from the same logits. The sampled ids stay on the device (`token_ids`, the next step's
input ids) and one download brings (token id, raw logprob) home. Growing the row buffers moves them, so
the sampling graphs are dropped then and captured again.

The captured forward is Llama.forward itself, given a capture-safe GEMM (cuda/graphs.py) as its matmul
(and for the LM head, the same GEMM writing fp32) and no logits_indices, so it computes logits for every row (a decode step samples every row). Attention plans its key
splits for max_context_len = max_model_len, a static bound, so the captured launch stays valid for
every replay. Everything the forward allocates comes from a private CuPy pool used only while warming
up and capturing; the output of each bucket is kept referenced, so no later capture or eager step can
reuse its memory, and the intermediates are only shared between graphs that never run at once.
"""
from __future__ import annotations

import itertools
import math

import cupy
import numpy as np

from offline_paged.cuda import sampling_launcher as kernels
from offline_paged.cuda.graphs import CublasGemm
from offline_paged.cuda.pinned import PinnedUpload
from offline_paged.models.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _Bucket:
    """Static inputs, the captured graph and its logits output for one batch size."""

    def __init__(self, size: int, max_blocks: int) -> None:
        self.size = size
        self.max_blocks = max_blocks
        self.host = np.zeros(7 * size + 1 + size * max_blocks, dtype=np.int32)  # packed inputs (host)
        self.device = cupy.zeros(self.host.size, dtype=cupy.int32)  # same layout (device)
        self.graph = None
        self.logits = None  # [b, V] float32, written by every replay
        self.sample_graph = None  # captured on the first sampled replay; dropped when the row buffers move
        self.sampled = None  # [b, 2] float64 (token id, raw logprob), written by every sampled replay
        self.token_ids = None  # [b] int32, the same ids for the next step's inputs

    def views(self, packed):
        """(input ids, positions, slot mapping, context lens, query_start_loc, block tables) of `packed`."""
        b = self.size
        ids, pos, slots, ctx = (packed[i * b:(i + 1) * b] for i in range(4))
        qsl = packed[4 * b:5 * b + 1]
        return ids, pos, slots, ctx, qsl, packed[7 * b + 1:].reshape(b, self.max_blocks)

    def sampling_views(self, packed):
        """(slot rows [b], sample positions [b]) of `packed`."""
        b = self.size
        return packed[5 * b + 1:6 * b + 1], packed[6 * b + 1:7 * b + 1]

    def pack(self, input_ids, positions, slot_mapping, block_tables, slot_rows=None, sample_positions=None) -> None:
        """Fill the host buffer for S <= b real rows; padding rows as in the module docstring.
        block_tables: a list of S block lists, or an [S, M'] array of zero-padded rows. slot_rows /
        sample_positions [S]: each row's persistent sampling row and output position (sampled replays)."""
        num_seqs = len(block_tables)
        ids, pos, slots, ctx, qsl, tables = self.views(self.host)
        rows, sample_pos = self.sampling_views(self.host)
        rows[:], sample_pos[:] = -1, 0
        if slot_rows is not None:
            rows[:num_seqs], sample_pos[:num_seqs] = slot_rows, sample_positions
        ids[:num_seqs], ids[num_seqs:] = input_ids, 0
        pos[:num_seqs], pos[num_seqs:] = positions, 0
        slots[:num_seqs], slots[num_seqs:] = slot_mapping, -1
        ctx[:num_seqs], ctx[num_seqs:] = np.asarray(positions) + 1, 1
        qsl[:] = np.arange(self.size + 1)
        tables[:] = 0
        if isinstance(block_tables, np.ndarray):  # [S, M'] zero-padded rows (the runner's BlockTableRows)
            width = min(block_tables.shape[1], self.max_blocks)
            tables[:num_seqs, :width] = block_tables[:, :width]
            return
        lens = np.fromiter(map(len, block_tables), np.int64, num_seqs)  # [S]
        tables[:num_seqs][np.arange(self.max_blocks) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), np.int64, int(lens.sum()))


class DecodeGraphs:
    """Captures lazily, on a bucket's first use. `run` replays on the current stream.

    model: a Llama on CudaOps in float16; kv_cache [L, 2, N, B, Hkv, D] (its address is captured)."""

    def __init__(self, model, kv_cache, block_size: int, max_model_len: int, buckets=BUCKETS) -> None:
        if model.dtype != np.float16:
            raise ValueError(f"CUDA graphs need a float16 model, got {model.dtype}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.buckets = tuple(sorted(buckets))
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = cupy.cuda.MemoryPool()  # only for warm-up and capture
        self._gemm = None
        self._captured: dict[int, _Bucket] = {}
        self._upload = PinnedUpload()  # the host packs the next step while this one runs
        self.num_replays = 0
        self.num_sampled_replays = 0
        self._row_params = None  # [Rp, 8] float64 (device): SamplingRows.params mirrored
        self._row_seeds = None  # [Rp] uint64 (device): SamplingRows.seeds mirrored

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def fits(self, num_seqs: int, max_context_len: int, max_table_len: int) -> bool:
        return (0 < num_seqs <= self.buckets[-1] and max_context_len <= self.max_model_len
                and max_table_len <= self.max_blocks)

    def run(self, input_ids, positions, slot_mapping, block_tables, timer=None, fill=None):
        """One decode step: token input_ids[i] at positions[i] of sequence i (its KV goes to
        slot_mapping[i]; -1 skips), block_tables[i] its blocks (lists, or zero-padded rows of an
        array). Returns the bucket's logits [b, V] float32 (device; rows >= S are padding), valid
        until this bucket's next replay. `timer` (a StepReport DeviceTimer) is started after the
        host packing, right before the input copy and the replay, so it times the device's work.
        `fill(ids)` writes pending input ids into the bucket's device ids after the copy (async
        scheduling), stream-ordered before the replay."""
        return self._replay(input_ids, positions, slot_mapping, block_tables, timer, fill)[1]

    def run_and_sample(self, input_ids, positions, slot_mapping, block_tables, slot_rows, sample_positions,
                       sampling_rows, timer=None, fill=None):
        """`run`, then sample every row in the bucket's sampling graph. slot_rows [S]: each row's row in
        `sampling_rows` (a SamplingRows, its new rows mirrored to the device first); sample_positions [S]:
        the output position each row samples. Returns (logits [b, V], PendingSamples of the S rows)."""
        from offline_paged.gpu_sampler import PendingSamples

        self._sync_rows(sampling_rows)
        bucket, logits = self._replay(input_ids, positions, slot_mapping, block_tables, timer, fill,
                                      slot_rows, sample_positions)
        if bucket.sample_graph is None:
            self._capture_sampling(bucket)
        bucket.sample_graph.launch()
        self.num_sampled_replays += 1
        num_seqs = len(block_tables)
        return logits, PendingSamples.of_graph(bucket.sampled[:num_seqs], bucket.token_ids[:num_seqs])

    def _replay(self, input_ids, positions, slot_mapping, block_tables, timer, fill, slot_rows=None,
                sample_positions=None):
        size = next(b for b in self.buckets if b >= len(block_tables))
        bucket = self._captured.get(size) or self._capture(size)
        bucket.pack(input_ids, positions, slot_mapping, block_tables, slot_rows, sample_positions)
        if timer is not None:
            timer.start()
        self._upload(bucket.host, out=bucket.device)  # the step's one H2D copy, queued before the replay
        if fill is not None:
            fill(bucket.views(bucket.device)[0])
        bucket.graph.launch()
        self.num_replays += 1
        return bucket, bucket.logits

    def _sync_rows(self, sampling_rows) -> None:
        """Mirror the rows SamplingRows packed since the last step (usually none) into the device buffers.
        When they must grow, reallocate, copy every row, and drop the sampling graphs (they hold the old
        addresses)."""
        dirty = sampling_rows.take_dirty()  # [d]
        if self._row_params is None or self._row_params.shape[0] < sampling_rows.num_rows:
            self._row_params = cupy.asarray(sampling_rows.params)  # [Rp, 8]
            self._row_seeds = cupy.asarray(sampling_rows.seeds)  # [Rp]
            for bucket in self._captured.values():
                bucket.sample_graph = None
            return
        if not dirty.size:
            return
        staged = np.concatenate([dirty.astype(np.uint64), sampling_rows.seeds[dirty],
                                 sampling_rows.params[dirty].ravel().view(np.uint64)])  # [d * 10] uint64
        device = self._upload(staged)  # [d * 10] uint64 (device)
        count = dirty.size
        rows = device[:count].astype(cupy.int64)  # [d]
        self._row_seeds[rows] = device[count:2 * count]
        self._row_params[rows] = device[2 * count:].view(cupy.float64).reshape(count, 8)

    # ----------------------------------------------------------------- capture
    def _capture(self, size: int) -> _Bucket:
        bucket = _Bucket(size, self.max_blocks)
        bucket.pack([], [], [], [])  # all rows padding: warm-up writes no KV
        bucket.device.set(bucket.host)
        cupy.cuda.Device().synchronize()
        with cupy.cuda.using_allocator(self._pool.malloc), self._stream:
            if self._gemm is None:
                self._gemm = CublasGemm(self._stream)
            self._forward(bucket)  # compiles kernels, initialises cuBLAS, fills the pool
            self._stream.synchronize()
            self._stream.begin_capture()
            try:
                bucket.logits = self._forward(bucket)
            finally:
                bucket.graph = self._stream.end_capture()
        self._stream.synchronize()
        self._captured[size] = bucket
        return bucket

    def _capture_sampling(self, bucket: _Bucket) -> None:
        """Capture the bucket's sampling graph (warmed up once first: kernels compile outside the capture).
        Its temporaries come from the private pool, like the forward's; `sampled` and `token_ids` stay."""
        cupy.cuda.Device().synchronize()
        with cupy.cuda.using_allocator(self._pool.malloc), self._stream:
            if bucket.sampled is None:
                bucket.sampled = cupy.zeros((bucket.size, 2), dtype=cupy.float64)  # [b, 2]
                bucket.token_ids = cupy.zeros(bucket.size, dtype=cupy.int32)  # [b]
            self._sample(bucket)
            self._stream.synchronize()
            self._stream.begin_capture()
            try:
                self._sample(bucket)
            finally:
                bucket.sample_graph = self._stream.end_capture()
        self._stream.synchronize()

    def _sample(self, bucket: _Bucket) -> None:
        """Every slot of bucket.logits sampled as GpuSampler.sample_async samples a row without penalties,
        bans or logprobs: prepare_rows -> top_cut -> race, then the ids as int32."""
        b, vocab = bucket.size, bucket.logits.shape[1]
        slot_rows, sample_positions = bucket.sampling_views(bucket.device)
        params = cupy.empty((b, kernels.PARAMS_WIDTH), dtype=cupy.float64)  # [b, 8]
        seeds = cupy.empty(b, dtype=cupy.uint64)  # [b]
        positions = cupy.empty(b, dtype=cupy.uint64)  # [b]
        kernels.gather_row_params(slot_rows, sample_positions, self._row_params, self._row_seeds,
                                  params, seeds, positions)
        rows = cupy.arange(b, dtype=cupy.int32)  # [b]: slot i samples logits row i
        adjusted = cupy.empty((b, vocab), dtype=cupy.float64)  # [b, V]
        raw_stats = cupy.empty((b, 2), dtype=cupy.float64)  # [b, 2]
        cut = cupy.empty(b, dtype=cupy.float64)  # [b]
        kernels.prepare_rows(bucket.logits, rows, adjusted, raw_stats)
        kernels.top_cut(adjusted, params, cut)
        kernels.race(adjusted, cut, raw_stats, bucket.logits, rows, params, seeds, positions, bucket.sampled)
        kernels.chosen_ids(bucket.sampled, bucket.token_ids)

    def _forward(self, bucket: _Bucket):
        """Llama.forward for one token per row through the capture-safe GEMM: every row's logits
        [b, V] float32, no host sync (attention plans its splits for the static max_model_len)."""
        ids, pos, slots, ctx, qsl, tables = bucket.views(bucket.device)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=ctx,
                                 query_start_loc=qsl, max_query_len=1, max_context_len=self.max_model_len)
        return self.model.forward(ids, pos, self.kv_cache, meta, None, matmul=self._gemm,
                                  logits_matmul=self._logits_gemm)

    def _logits_gemm(self, hidden, lm_head):
        """The LM head through the same capture-safe handle, writing its fp32 accumulator."""
        return self._gemm(hidden, lm_head, out_dtype=np.float32)
