"""DecodeGraphs: decode-only steps (one new token per sequence) replayed from CUDA graphs, one per bucket.

Legend: S sequences in the step, b bucket size (S rounded up), M max blocks per sequence
(ceil(max_model_len / B)), B block size, E hidden size, V vocab, L layers.

Per bucket b one packed int32 device buffer holds the step's inputs at fixed addresses:
    [input ids b | positions b | slot mapping b | context lens b | query_start_loc b + 1 | block tables b*M]
A step packs them on the host, copies them over in one H2D copy and launches the graph captured for b.
Rows S..b are padding: token 0 at position 0, slot -1 (no KV write), context len 1 reading block 0 slot 0
(whatever is there; their logits are never read).

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

from offline_paged.cuda.graphs import CublasGemm
from offline_paged.cuda.pinned import PinnedUpload
from offline_paged.models.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _Bucket:
    """Static inputs, the captured graph and its logits output for one batch size."""

    def __init__(self, size: int, max_blocks: int) -> None:
        self.size = size
        self.max_blocks = max_blocks
        self.host = np.zeros(5 * size + 1 + size * max_blocks, dtype=np.int32)  # packed inputs (host)
        self.device = cupy.zeros(self.host.size, dtype=cupy.int32)  # same layout (device)
        self.graph = None
        self.logits = None  # [b, V] float32, written by every replay

    def views(self, packed):
        """(input ids, positions, slot mapping, context lens, query_start_loc, block tables) of `packed`."""
        b = self.size
        ids, pos, slots, ctx = (packed[i * b:(i + 1) * b] for i in range(4))
        qsl = packed[4 * b:5 * b + 1]
        return ids, pos, slots, ctx, qsl, packed[5 * b + 1:].reshape(b, self.max_blocks)

    def pack(self, input_ids, positions, slot_mapping, block_tables) -> None:
        """Fill the host buffer for S <= b real rows; padding rows as in the module docstring.
        block_tables: a list of S block lists, or an [S, M'] array of zero-padded rows."""
        num_seqs = len(block_tables)
        ids, pos, slots, ctx, qsl, tables = self.views(self.host)
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


GRAPH_DTYPES = ("float16", "bfloat16")  # model dtypes the capture-safe GEMM and kernels take


class DecodeGraphs:
    """Captures lazily, on a bucket's first use. `run` replays on the current stream.

    model: a Llama on CudaOps in float16 or bfloat16; kv_cache [L, 2, N, B, Hkv, D] (its address is
    captured)."""

    def __init__(self, model, kv_cache, block_size: int, max_model_len: int, buckets=BUCKETS) -> None:
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
        self._captured: dict[int, _Bucket] = {}
        self._upload = PinnedUpload()  # the host packs the next step while this one runs
        self.num_replays = 0

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
        size = next(b for b in self.buckets if b >= len(block_tables))
        bucket = self._captured.get(size) or self._capture(size)
        bucket.pack(input_ids, positions, slot_mapping, block_tables)
        if timer is not None:
            timer.start()
        self._upload(bucket.host, out=bucket.device)  # the step's one H2D copy, queued before the replay
        if fill is not None:
            fill(bucket.views(bucket.device)[0])
        bucket.graph.launch()
        self.num_replays += 1
        return bucket.logits

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
