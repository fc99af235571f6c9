"""MixedGraphs: steps that prefill (alone or beside decodes) replayed piecewise from CUDA graphs, one set per
token-count bucket.

Legend: T tokens in the step, b bucket size (T rounded up), L layers, H query heads, D head dim, E hidden size,
K logits rows, V vocab.

A decode step's attention has one shape per batch size, so DecodeGraphs (cuda_graph_runner.py) captures all of
it. A step that prefills does not: its attention launch (kernel, grid, key splits) depends on the query and
context lengths of the step. So, as vLLM's piecewise graphs do, everything but attention is captured, per bucket
of b tokens, in L + 1 pieces: piece 0 is the embedding through layer 0's RoPE and KV write; piece i (0 < i < L)
is layer i-1's o_proj through layer i's KV write; piece L ends with the final norm of all b rows. Between the
pieces the step runs attention eagerly, with its real metadata, on the first T rows of the q that the piece
before produced, into the bucket's persistent [b, H, D] output that the next piece reads. After the last piece
the K wanted rows of the final hidden states go through the LM head eagerly (Llama.logits), so the logits are
those of an eager step's rows.

Per bucket one int32 device buffer holds [input ids b | positions b | slots b] at fixed addresses; a step
copies them from its eager upload (`pack_eager(pad_to=b)`: padding rows are token 0 at position 0 with slot -1,
so they write no KV; their rows are never read). Rows compute independently in every captured kernel, so
padding changes no real row.

Memory. Captures run on a private stream and pool, as DecodeGraphs' do. A piece's temporaries return to the
pool during the capture and are reused by later pieces (and buckets): that is safe because replays run in
capture order on one stream and buckets never run at once. The q each piece ends with is kept as a view that
does not hold its memory (`_unowned`): the attention right after the piece reads it before any later piece can
reuse that memory, and holding L of them per bucket would cost L x b x H x D elements each. The attention output
and the final hidden states are held (they cross a piece boundary as inputs).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import cupy
import numpy as np

from offline_paged.ops.attention import AttentionMetadata
from offline_paged.ops.cublaslt import TunedGemm
from offline_paged.ops.graphs import gc_paused, uploaded
from offline_paged.worker.cuda_graph_runner import GRAPH_DTYPES
from offline_paged.worker.graph_buckets import MIXED_BUCKETS, bucket_for


@dataclass(slots=True)
class _Cut:
    """One attention between two pieces, as the capture saw it: the layer's q (an `_unowned` view), caches,
    scale and keyword arguments."""

    q: Any  # [b, H, D]
    k_cache: Any
    v_cache: Any
    scale: float
    kwargs: dict


@dataclass(slots=True)
class _Bucket:
    size: int
    inputs: Any  # [3 b] int32 (device): input ids, positions, slots
    out: Any = None  # [b, H, D]: every layer's attention output (held)
    hidden: Any = None  # [b, E]: the final-normed hidden states (held)
    pieces: list = field(default_factory=list)  # L + 1 graphs
    cuts: list[_Cut] = field(default_factory=list)  # L attentions, one after each piece but the last

    def views(self):
        """(input ids, positions, slots) [b] each."""
        b = self.size
        return self.inputs[:b], self.inputs[b:2 * b], self.inputs[2 * b:]


class MixedGraphs:
    """Piecewise graphs of a Llama on CudaOps (float16 or bfloat16, no tensor parallelism) over kv_cache
    [L, 2, N, B, Hkv, D] (its address is captured). Captures lazily on a bucket's first use, or all at once
    (`capture_all`)."""

    def __init__(self, model, kv_cache, buckets=MIXED_BUCKETS) -> None:
        if np.dtype(model.dtype).name not in GRAPH_DTYPES:
            raise ValueError(f"CUDA graphs need a float16 or bfloat16 model, got {model.dtype}")
        if model.tp is not None:
            raise ValueError("mixed-step graphs do not run under tensor parallelism")
        if not buckets:
            raise ValueError("MixedGraphs needs at least one bucket")
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = tuple(sorted(buckets))
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = cupy.cuda.MemoryPool()  # only for warm-up and capture
        self._gemm = TunedGemm(self._stream)
        self._captured: dict[int, _Bucket] = {}
        self.num_replays = 0

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def bucket_for(self, num_tokens: int) -> int | None:
        """The bucket a step of num_tokens tokens replays, or None when it runs eagerly: more tokens than the
        largest bucket, or an FP8 KV cache whose scales the first prefill still has to calculate (an eager step
        does that; a replay would keep 1.0)."""
        return None if self._scales_pending() else bucket_for(self.buckets, num_tokens)

    def _scales_pending(self) -> bool:
        return any(layer.kv_scales is not None and layer.kv_scales.calculate for layer in self.model.layers)

    def capture_all(self) -> None:
        """Capture every bucket now (engine start): a capture costs two forwards of its size."""
        for size in self.buckets:
            if size not in self._captured:
                self._capture(size)

    def run(self, batch, num_tokens: int, size: int):
        """The forward of a step of num_tokens tokens, packed with `pack_eager(pad_to=size)` and uploaded
        (`batch`, an EagerBatch: its input ids, positions and slots are [size], its metadata and logits rows the
        real ones; size = bucket_for(num_tokens)). Returns float32 logits [K, V] of batch.logits_indices, as
        Llama.forward does. Everything is queued on the current stream; nothing waits for the device."""
        bucket = self._captured.get(size) or self._capture(size)
        for source, target in zip((batch.input_ids, batch.positions, batch.meta.slot_mapping), bucket.views()):
            target.data.copy_from_device_async(source.data, target.nbytes)
        attention, out = self.model.ops.attention, bucket.out[:num_tokens]  # [T, H, D]
        for piece, cut in zip(bucket.pieces, bucket.cuts):
            piece.launch()
            attention(cut.q[:num_tokens], cut.k_cache, cut.v_cache, batch.meta, cut.scale, out=out, **cut.kwargs)
        bucket.pieces[-1].launch()
        self.num_replays += 1
        return self.model.logits(bucket.hidden[batch.logits_indices])  # [K, V] float32

    # ----------------------------------------------------------------- capture
    def _capture(self, size: int) -> _Bucket:
        bucket = _Bucket(size, cupy.zeros(3 * size, dtype=cupy.int32))
        ids, positions, slots = bucket.views()
        slots.fill(-1)  # the warm-up and the capture write no KV
        config = self.model.config
        meta = AttentionMetadata(slot_mapping=slots, block_tables=None, context_lens=None, query_start_loc=None,
                                 max_query_len=0, max_context_len=0)  # only the slots are read (attention is cut)
        cupy.cuda.Device().synchronize()
        with cupy.cuda.using_allocator(self._pool.malloc), self._stream:
            bucket.out = cupy.zeros((size, config.num_attention_heads, config.head_dim), dtype=self.model.dtype)
            self.model.final_hidden(ids, positions, self.kv_cache, meta, matmul=self._gemm,
                                    attention=lambda *args, **kwargs: _held_output(bucket, kwargs))  # warm-up
            self._stream.synchronize()
            with gc_paused():
                self._stream.begin_capture()
                try:
                    bucket.hidden = self.model.final_hidden(ids, positions, self.kv_cache, meta, matmul=self._gemm,
                                                            attention=self._cutter(bucket))
                except BaseException:
                    with contextlib.suppress(cupy.cuda.runtime.CUDARuntimeError):
                        self._stream.end_capture()  # leaves capture mode; the partial graph is dropped
                    raise
                bucket.pieces.append(self._stream.end_capture())
        self._stream.synchronize()
        bucket.pieces = [uploaded(piece) for piece in bucket.pieces]
        self._captured[size] = bucket
        return bucket

    def _cutter(self, bucket: _Bucket):
        """The `attention` the capture's forward calls: it ends the piece so far, notes the call, starts the next
        piece and returns the bucket's attention output for the next piece to read."""
        def cut(q, k_cache, v_cache, meta, scale, **kwargs):
            bucket.pieces.append(self._stream.end_capture())
            replay_kwargs = {key: value for key, value in kwargs.items() if key != "feeds"}  # (run writes `out`)
            bucket.cuts.append(_Cut(_unowned(q), k_cache, v_cache, scale, replay_kwargs))
            self._stream.begin_capture()
            return _held_output(bucket, kwargs)

        return cut


def _held_output(bucket: _Bucket, kwargs):
    """What the model's attention call gets back inside a capture: the bucket's output [b, H, D], or with `feeds`
    (the linear it goes into) its rows [b, H D], which the next piece reads (and quantizes, for an FP8 layer)."""
    return bucket.out if kwargs.get("feeds") is None else bucket.out.reshape(bucket.out.shape[0], -1)


def _unowned(array):
    """A view of a C-contiguous `array` that does not keep its memory allocated (the module docstring says why
    that is safe for a piece's q)."""
    memory = cupy.cuda.UnownedMemory(array.data.ptr, array.nbytes, None, array.device.id)
    return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0))
