"""DecodeGraphs: decode-only steps (one new token per sequence) replayed from CUDA graphs, one per bucket.

Legend: S sequences in the step, b bucket size (S rounded up), M max blocks per sequence
(ceil(max_model_len / B)), B block size, E hidden size, V vocab, L layers, R persistent rows.

Per bucket b one packed int32 device buffer holds the step's inputs at fixed addresses:
    uploaded: [input ids b | slot rows b | sample positions b | positions b | write flags b]
    computed: [slot mapping b | context lens b | query_start_loc b + 1 | launch order b | block tables b*M]
A step packs the five uploaded fields on the host (a few ints per sequence), copies them in one H2D copy,
and `decode_inputs` (cuda/step_inputs.cu) computes the rest on the device from a device mirror of the
runner's BlockTableRows [R, Mr], kept current by the entries that changed (`take_changes`: a new block
per sequence every B steps, copy-on-write replacements); a new generation of the rows (more rows or
columns) is copied whole. `launch_order` (the same file) then ranks the slots by context length, longest
first: attention launches its CTAs in that order, which evens out the grid's last wave. Then the graph
captured for b is launched. Slots S..b are padding: slot row
-1, token 0 at position 0, slot -1 (no KV write), context len 1 reading block 0 slot 0 (whatever is
there; their logits are never read).

Sampling inside the graph (`run_and_sample`): a second graph per bucket, captured on its first use, samples
every slot of the bucket's logits with the eager GpuSampler's kernels (top_cut -> race, cuda/sampling.cu, in
their variants that read the fp32 logits rows in place instead of a float64 copy) after gathering each slot's (params, seed, output position) from persistent row buffers
[R, 8] float64 / [R] uint64 that are written only when a row gets a new sequence (SamplingRows). The
random stream is a function of (seed, output position) read from device buffers, so a replay draws what the
eager sampler draws from the same logits. The sampled ids stay on the device (`token_ids`, the next step's
input ids) and one download brings (token id, raw logprob) home. Growing the row buffers moves them, so
the sampling graphs are dropped then and captured again (the table mirror is read outside the graphs).

The captured forward is Llama.forward itself, given a capture-safe GEMM (offline_paged/ops/graphs.py) as its matmul
(and for the LM head, the same GEMM writing fp32) and no logits_indices, so it computes logits for every row (a decode step samples every row). Attention plans its key
splits for max_context_len = max_model_len, a static bound, so the captured launch stays valid for
every replay. Everything the forward allocates comes from a private CuPy pool used only while warming
up and capturing; the output of each bucket is kept referenced, so no later capture or eager step can
reuse its memory, and the intermediates are only shared between graphs that never run at once. The LM
head of every bucket writes into one shared [b_max, V] float32 buffer (the largest output by far), so
many buckets cost little memory; the engine captures them all at start (`capture_all`).
"""
from __future__ import annotations

import contextlib
import math

import cupy
import numpy as np

from offline_paged.ops import sampling_launcher as kernels
from offline_paged.ops import step_inputs_launcher as step_kernels
from offline_paged.ops.attention import AttentionMetadata
from offline_paged.ops.cublaslt import TunedGemm
from offline_paged.ops.graphs import gc_paused, uploaded
from offline_paged.ops.pinned import PinnedUpload, pin_in_place
from offline_paged.ops.swap import pinned_empty
from offline_paged.worker.graph_buckets import DECODE_BUCKETS


class _Bucket:
    """Static inputs, the captured graphs and their outputs for one batch size."""

    NUM_UPLOADED = 5  # input ids, slot rows, sample positions, positions, write flags

    def __init__(self, size: int, max_blocks: int) -> None:
        self.size = size
        self.max_blocks = max_blocks
        self.host = np.zeros(self.NUM_UPLOADED * size, dtype=np.int32)  # the uploaded fields (host)
        self.device = cupy.zeros(9 * size + 1 + size * max_blocks, dtype=cupy.int32)  # the layout above
        self.graph = None
        self.logits = None  # [b, V] float32, written by every replay
        self.sample_graph = None  # captured on the first sampled replay; dropped when the row buffers move
        self.masked_sample_graph = None  # the same with structured-output masks (`sample_masked`)
        self.masks = None  # [b, W] int32 packed masks the masked sampling graph applies
        self.sampled = None  # [b, 2] float64 (token id, raw logprob), written by every sampled replay
        self.token_ids = None  # [b] int32, the same ids for the next step's inputs

    def uploaded(self, packed):
        """(input ids, slot rows, sample positions, positions, write flags) [b] each of `packed`."""
        b = self.size
        return tuple(packed[i * b:(i + 1) * b] for i in range(self.NUM_UPLOADED))

    def views(self, packed):
        """(input ids, positions, slot mapping, context lens, query_start_loc, launch order, block tables)
        of `packed`."""
        b = self.size
        ids, _, _, pos, _ = self.uploaded(packed)
        slots, ctx = packed[5 * b:6 * b], packed[6 * b:7 * b]
        qsl, order = packed[7 * b:8 * b + 1], packed[8 * b + 1:9 * b + 1]
        return ids, pos, slots, ctx, qsl, order, packed[9 * b + 1:].reshape(b, self.max_blocks)

    def sampling_views(self, packed):
        """(slot rows [b], sample positions [b]) of `packed`."""
        return self.uploaded(packed)[1:3]

    def pack(self, input_ids, positions, slot_rows, writes, sample_positions=None) -> None:
        """Fill the host fields for S <= b real slots (S = len(slot_rows)); padding as in the module docstring."""
        num_seqs = len(slot_rows)
        ids, rows, sample_pos, pos, write = self.uploaded(self.host)
        ids[:num_seqs], ids[num_seqs:] = input_ids, 0
        rows[:num_seqs], rows[num_seqs:] = slot_rows, -1
        sample_pos[:num_seqs], sample_pos[num_seqs:] = 0 if sample_positions is None else sample_positions, 0
        pos[:num_seqs], pos[num_seqs:] = positions, 0
        write[:num_seqs], write[num_seqs:] = writes, 0


GRAPH_DTYPES = ("float16", "bfloat16")  # model dtypes the capture-safe GEMM and kernels take


class DecodeGraphs:
    """Captures lazily, on a bucket's first use. `run` replays on the current stream.

    model: a Llama on CudaOps in float16 or bfloat16; kv_cache [L, 2, N, B, Hkv, D] (its address is
    captured)."""

    def __init__(self, model, kv_cache, block_size: int, max_model_len: int, buckets=DECODE_BUCKETS) -> None:
        if np.dtype(model.dtype).name not in GRAPH_DTYPES:
            raise ValueError(f"CUDA graphs need a float16 or bfloat16 model, got {model.dtype}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.buckets = tuple(sorted(buckets))
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = cupy.cuda.MemoryPool()  # only for warm-up and capture
        self._gemm = None
        self._logits_out = None  # [b_max, V] float32: every bucket's LM head writes its first b rows
        self._captured: dict[int, _Bucket] = {}
        # One PinnedUpload per kind of upload: each is used once per step, so its staging slots are never
        # rewritten while the step in flight may still be copying from them.
        self._upload = PinnedUpload()  # the host packs the next step while this one runs
        self._table_upload = PinnedUpload()
        self._row_upload = PinnedUpload()
        self._mask_upload = PinnedUpload()
        self._mask_staging = [(None, np.empty((0, 0), np.int32))] * 2  # (source, pinned [b_max, W] int32) each
        self._next_staging = 0
        self._last_run = None  # (bucket, S) of the last replay, for sample_masked
        self.num_replays = 0
        self.num_sampled_replays = 0
        self.num_sampling_captures = 0  # unmasked sampling graphs captured (capture_all, or on first use)
        self.num_masked_captures = 0  # masked ones (every bucket's on the first masked sampling)
        self._row_tables = None  # [R, Mr] int32 (device): BlockTableRows.tables mirrored
        self._tables_generation = None  # (the BlockTableRows mirrored, its generation)
        self._row_params = None  # [R, 8] float64 (device): SamplingRows.params mirrored
        self._row_seeds = None  # [R] uint64 (device): SamplingRows.seeds mirrored
        self._rows_source = None  # the SamplingRows mirrored

    def capture_all(self, sampling_rows=None) -> None:
        """Capture every bucket's forward graph now (engine start), not on the first step of each size, and
        with `sampling_rows` (the SamplingRows run_and_sample will be given) its sampling graph too. A capture
        waits for the device to be idle and costs an eager run: inside a run, each stalled the step pipeline
        (Qwen3-0.6B bench on the H200: 21 lazy sampling captures, 126 ms of host waits in a 5.9 s run). The
        sampling graphs hold the row buffers' addresses: rows that outgrow them recapture on first use."""
        for size in self.buckets:
            if size not in self._captured:
                self._capture(size)
        if sampling_rows is not None:
            self._sync_rows(sampling_rows)
            for bucket in self._captured.values():
                if bucket.sample_graph is None:
                    self._capture_sampling(bucket)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def fits(self, num_seqs: int, max_context_len: int, max_table_len: int) -> bool:
        return (0 < num_seqs <= self.buckets[-1] and max_context_len <= self.max_model_len
                and max_table_len <= self.max_blocks)

    def run(self, input_ids, positions, slot_rows, writes, table_rows, timer=None, fill=None, sample_positions=None):
        """One decode step: slot i computes token input_ids[i] at positions[i] of the sequence whose block
        table is row slot_rows[i] of `table_rows` (a BlockTableRows, synced for this step); writes[i] = 0
        leaves its (cached) K/V unwritten. Returns the bucket's logits [b, V] float32 (device; rows >= S
        are padding), valid until the next replay (the buckets share one logits buffer). `timer` (a StepReport DeviceTimer) is started
        after the host packing, right before the input copy and the replay, so it times the device's work.
        `fill(ids)` writes pending input ids into the bucket's device ids after the copy (async
        scheduling), stream-ordered before the replay. sample_positions [S]: the output positions
        `sample_masked` will sample (packed with the step's inputs)."""
        return self._replay(input_ids, positions, slot_rows, writes, table_rows, timer, fill, sample_positions)[1]

    def run_and_sample(self, input_ids, positions, slot_rows, writes, table_rows, sample_positions,
                       sampling_rows, timer=None, fill=None):
        """`run`, then sample every slot in the bucket's sampling graph: slot i draws output position
        sample_positions[i] with the parameters of row slot_rows[i] of `sampling_rows` (a SamplingRows,
        its new rows mirrored to the device first). Returns (logits [b, V], PendingSamples of the S slots)."""
        from offline_paged.worker.gpu_sampler import PendingSamples

        self._sync_rows(sampling_rows)
        bucket, logits = self._replay(input_ids, positions, slot_rows, writes, table_rows, timer, fill,
                                      sample_positions)
        if bucket.sample_graph is None:
            self._capture_sampling(bucket)
        bucket.sample_graph.launch()
        self.num_sampled_replays += 1
        num_seqs = len(slot_rows)
        return logits, PendingSamples.of_graph(bucket.sampled[:num_seqs], bucket.token_ids[:num_seqs])

    def mask_staging(self, num_seqs: int, num_words: int, host_rows=None) -> np.ndarray:
        """[num_seqs, num_words] int32 pinned host rows to fill the next `sample_masked`'s masks into: it
        copies them to the device without staging them first. Two buffers used in turn: the one handed
        out was last copied from two steps ago, and the engine keeps at most one step in flight.
        host_rows: where the buffers live, a callable (rows, words) -> int32 array (a MaskServer's shared
        memory) that this pins; None: pinned memory of our own. A buffer from another source is replaced."""
        index, self._next_staging = self._next_staging, 1 - self._next_staging
        source, staging = self._mask_staging[index]
        if staging.shape[1] != num_words or staging.shape[0] < num_seqs or source != host_rows:
            shape = (max(num_seqs, self.buckets[-1]), num_words)  # [b_max, W]
            staging = pinned_empty(shape, np.int32) if host_rows is None else pin_in_place(host_rows(*shape))
            self._mask_staging[index] = (host_rows, staging)
        return staging[:num_seqs]

    def sample_masked(self, masks: np.ndarray, sampling_rows):
        """Sample the S slots of the last `run` (before any other replay) in the bucket's masked sampling
        graph: as `run_and_sample`'s sampler, on a float64 copy of the logits with masks [S, W] int32
        applied first (structured output; all bits set: no constraint), i.e. the eager GpuSampler's
        kernels in its order. Needs 32 W >= V (`masks_fit`). masks: host rows, best a `mask_staging`
        view (copied as they are). Returns PendingSamples of the S slots."""
        from offline_paged.worker.gpu_sampler import PendingSamples

        if self._last_run is None:
            raise RuntimeError("sample_masked needs a replay of its own (`run`) before it")
        bucket, num_seqs = self._last_run
        self._last_run = None
        if masks.shape[0] != num_seqs or not self.masks_fit(masks.shape[1]):
            raise ValueError(f"masks {masks.shape} do not fit {num_seqs} slots of {bucket.logits.shape[1]} logits")
        self._sync_rows(sampling_rows)
        if bucket.masks is None or bucket.masks.shape[1] != masks.shape[1]:
            self._capture_masked_all(masks.shape[1])
        if any(masks.ctypes.data == staging.ctypes.data for _, staging in self._mask_staging if staging.size):
            bucket.masks[:num_seqs].set(masks)  # pinned: queued, returns at once
        else:
            self._mask_upload(np.ascontiguousarray(masks, dtype=np.int32), out=bucket.masks[:num_seqs])
        if bucket.masked_sample_graph is None:  # (dropped when the sampling rows grew)
            self._capture_masked(bucket)
        bucket.masked_sample_graph.launch()
        self.num_sampled_replays += 1
        return PendingSamples.of_graph(bucket.sampled[:num_seqs], bucket.token_ids[:num_seqs])

    def _capture_masked_all(self, num_words: int) -> None:
        """Every captured bucket's masked sampling graph for masks of num_words words, at once, on the first
        masked sampling (or a new mask width): each capture waits for the device to be idle, so one by one
        on each bucket's first use they stalled the step pipeline of a structured run up to once per bucket.
        The buckets' masks start all set (no constraint); the graphs read them as the steps upload them."""
        for bucket in self._captured.values():
            if bucket.masks is None or bucket.masks.shape[1] != num_words:
                bucket.masks = cupy.full((bucket.size, num_words), -1, dtype=cupy.int32)  # [b, W]
                bucket.masked_sample_graph = None
            if bucket.masked_sample_graph is None:
                self._capture_masked(bucket)

    def _capture_masked(self, bucket: _Bucket) -> None:
        self._ensure_sample_outputs(bucket)
        bucket.masked_sample_graph, _ = self._capture_graph(lambda: self._sample(bucket, masked=True))
        self.num_masked_captures += 1

    def sampled_ids(self, num_seqs: int):
        """[S] int32 (device): where the next `sample_masked` of the last `run`'s S slots writes their ids."""
        bucket, _ = self._last_run
        self._ensure_sample_outputs(bucket)
        return bucket.token_ids[:num_seqs]

    def masks_fit(self, num_words: int) -> bool:
        """Whether masks of num_words int32 words cover every logit (else the eager sampler applies them:
        a padded vocabulary's tail is allowed for unconstrained rows there)."""
        return self._logits_out is not None and 32 * num_words >= self._logits_out.shape[1]

    def _replay(self, input_ids, positions, slot_rows, writes, table_rows, timer, fill, sample_positions=None):
        size = next(b for b in self.buckets if b >= len(slot_rows))
        bucket = self._captured.get(size) or self._capture(size)
        bucket.pack(input_ids, positions, slot_rows, writes, sample_positions)
        if timer is not None:
            timer.start()
        self._upload(bucket.host, out=bucket.device[:bucket.host.size])  # the step's input copy
        self._sync_tables(table_rows)
        self._decode_inputs(bucket)
        if fill is not None:
            fill(bucket.views(bucket.device)[0])
        bucket.graph.launch()
        self.num_replays += 1
        self._last_run = (bucket, len(slot_rows))
        return bucket, bucket.logits

    def _decode_inputs(self, bucket: _Bucket) -> None:
        """Slot mapping, context lens, query_start_loc, launch order and block tables of the bucket, on the
        device."""
        _, rows, _, pos, write = bucket.uploaded(bucket.device)
        _, _, slots, ctx, qsl, order, tables = bucket.views(bucket.device)
        row_tables = self._row_tables if self._row_tables is not None else cupy.zeros((1, 1), dtype=cupy.int32)
        step_kernels.decode_inputs(rows, pos, write, row_tables, slots, ctx, qsl, tables, self.block_size)
        step_kernels.launch_order(ctx, order)

    def _sync_tables(self, table_rows) -> None:
        """Bring the device mirror of table_rows.tables up to date: the changed entries, or all of it
        after a reallocation."""
        changes = table_rows.take_changes()  # [n, 3]
        if self._tables_generation != (table_rows, table_rows.generation):  # another object or reallocated
            self._row_tables = self._table_upload(table_rows.tables)  # [R, Mr] int32, a new device array
            self._tables_generation = (table_rows, table_rows.generation)
        elif changes.shape[0]:
            step_kernels.scatter_table_entries(self._table_upload(changes), self._row_tables)

    def _sync_rows(self, sampling_rows) -> None:
        """Mirror the rows SamplingRows packed since the last step (usually none) into the device buffers.
        When they must grow, reallocate, copy every row, and drop the sampling graphs (they hold the old
        addresses)."""
        dirty = sampling_rows.take_dirty()  # [d]
        if (sampling_rows is not self._rows_source or self._row_params is None
                or self._row_params.shape[0] < sampling_rows.num_rows):
            self._rows_source = sampling_rows
            self._row_params = cupy.asarray(sampling_rows.params)  # [R, 8] (a rare, synchronous copy)
            self._row_seeds = cupy.asarray(sampling_rows.seeds)  # [R]
            for bucket in self._captured.values():
                bucket.sample_graph = bucket.masked_sample_graph = None
            return
        if not dirty.size:
            return
        staged = np.concatenate([dirty.astype(np.uint64), sampling_rows.seeds[dirty],
                                 sampling_rows.params[dirty].ravel().view(np.uint64)])  # [d * 10] uint64
        device = self._row_upload(staged)  # [d * 10] uint64 (device)
        count = dirty.size
        rows = device[:count].astype(cupy.int64)  # [d]
        self._row_seeds[rows] = device[count:2 * count]
        self._row_params[rows] = device[2 * count:].view(cupy.float64).reshape(count, 8)

    # ----------------------------------------------------------------- capture
    def _capture(self, size: int) -> _Bucket:
        bucket = _Bucket(size, self.max_blocks)
        bucket.pack([], [], [], [])  # all slots padding: warm-up writes no KV
        bucket.device[:bucket.host.size].set(bucket.host)
        self._decode_inputs(bucket)
        if self._gemm is None:
            self._gemm = TunedGemm(self._stream)
        bucket.graph, bucket.logits = self._capture_graph(lambda: self._forward(bucket))
        self._captured[size] = bucket
        return bucket

    def _capture_sampling(self, bucket: _Bucket) -> None:
        """Capture the bucket's sampling graph. Its temporaries come from the private pool, like the
        forward's. `sampled` and `token_ids` outlive the step (the download, the next step's input ids),
        so they come from the default pool: no graph's temporaries can ever share their memory."""
        self._ensure_sample_outputs(bucket)
        bucket.sample_graph, _ = self._capture_graph(lambda: self._sample(bucket))
        self.num_sampling_captures += 1

    @staticmethod
    def _ensure_sample_outputs(bucket: _Bucket) -> None:
        if bucket.sampled is None:
            bucket.sampled = cupy.zeros((bucket.size, 2), dtype=cupy.float64)  # [b, 2]
            bucket.token_ids = cupy.zeros(bucket.size, dtype=cupy.int32)  # [b]

    def _capture_graph(self, work):
        """(graph, result) of `work()` captured on the private stream: run once first (kernels compile, the
        GEMM picks its algorithms, the private pool fills), then captured with the garbage collector
        paused. If the capture fails, the exception propagates and no graph is kept: the next use
        captures again (a graph ended after a failure would be a partial one)."""
        cupy.cuda.Device().synchronize()
        with cupy.cuda.using_allocator(self._pool.malloc), self._stream:
            work()
            self._stream.synchronize()
            with gc_paused():
                self._stream.begin_capture()
                try:
                    result = work()
                except BaseException:
                    with contextlib.suppress(cupy.cuda.runtime.CUDARuntimeError):
                        self._stream.end_capture()  # leaves capture mode; the partial graph is dropped
                    raise
                graph = self._stream.end_capture()
        self._stream.synchronize()
        return uploaded(graph), result

    def _sample(self, bucket: _Bucket, masked: bool = False) -> None:
        """Every slot of bucket.logits sampled as GpuSampler.sample_async samples a row without penalties,
        bans or logprobs: top_cut -> race on the logits rows in place (no float64 copy), then the ids as int32.
        masked: bucket.masks applied as the eager sampler's prepare_rows -> apply_token_bitmask -> top_cut ->
        race applies them (the raw logprob stays the unmasked row's), but read in place too: the float64 copy
        was ~0.8 GB of traffic a 256-row step at a 128k vocabulary."""
        b = bucket.size
        slot_rows, sample_positions = bucket.sampling_views(bucket.device)
        params = cupy.empty((b, kernels.PARAMS_WIDTH), dtype=cupy.float64)  # [b, 8]
        seeds = cupy.empty(b, dtype=cupy.uint64)  # [b]
        positions = cupy.empty(b, dtype=cupy.uint64)  # [b]
        kernels.gather_row_params(slot_rows, sample_positions, self._row_params, self._row_seeds,
                                  params, seeds, positions)
        rows = cupy.arange(b, dtype=cupy.int32)  # [b]: slot i samples logits row i
        cut = cupy.empty(b, dtype=cupy.float64)  # [b]
        masks = bucket.masks if masked else None  # [b, W]
        kernels.top_cut_logits(bucket.logits, rows, params, cut, masks)
        kernels.race_logits(cut, bucket.logits, rows, params, seeds, positions, bucket.sampled, masks)
        kernels.chosen_ids(bucket.sampled, bucket.token_ids)

    def _forward(self, bucket: _Bucket):
        """Llama.forward for one token per row through the capture-safe GEMM: every row's logits
        [b, V] float32, no host sync (attention plans its splits for the static max_model_len)."""
        ids, pos, slots, ctx, qsl, order, tables = bucket.views(bucket.device)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=ctx,
                                 query_start_loc=qsl, max_query_len=1, max_context_len=self.max_model_len,
                                 unqueried_rows=False, launch_order=order)
        return self.model.forward(ids, pos, self.kv_cache, meta, None, matmul=self._gemm,
                                  logits_matmul=self._logits_gemm)

    def _logits_gemm(self, hidden, lm_head):
        """The LM head through the same capture-safe handle, writing its fp32 accumulator into the first
        b rows of one buffer shared by every bucket (allocated in the first warm-up, outside any capture).
        Sharing is safe: replays and whatever reads their logits are ordered on one stream."""
        if self._logits_out is None:
            self._logits_out = cupy.empty((self.buckets[-1], lm_head.shape[1]), dtype=cupy.float32)
        return self._gemm(hidden, lm_head, out_dtype=np.float32, out=self._logits_out[:hidden.shape[0]])
