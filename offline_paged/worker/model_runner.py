"""ModelRunner: turns a SchedulerOutput into arrays, moves KV blocks, runs the model and samples.

Legend: T tokens in the step, S scheduled sequences, M max blocks per sequence, K logits rows,
V vocab, L layers, N device blocks, C CPU blocks, B block size, Hkv KV heads, D head dim.

Order inside one step matters: swap-outs first (their device blocks may be handed to someone else
in this very step), then swap-ins, then copy-on-write copies, then the forward. Logits cross to the
host once per step, and only the rows that are sampled or scored. On CUDA the GpuSampler samples on the
device (only the sampled ids and requested log-probabilities come back); logits cross only for rows whose
prompt log-probabilities are asked for. Decode-only steps that fit a bucket replay a CUDA graph
(cuda_graph_runner.py) whose inputs are derived on the device from the persistent rows; when every row
is greedy or temperature / top-k / top-p / min-p only, the graph samples too (same kernels, per-row
parameters in device buffers written once per row), else the GpuSampler samples its logits. Step inputs
are built in step_inputs.py.

Tensor parallel: rank 0's runner is given a `mirror` (offline_paged/tp/tp_group.py) and sends it each
step's block moves and packed forward inputs (a MirroredStep) right before its own forward; the runner of every other
rank replays them with `run_mirrored` (same block ids, same buckets), so the collectives inside the
forwards pair up. Only rank 0 samples.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from offline_paged.core.sequence import SequenceResult
from offline_paged.ops.attention import AttentionMetadata
from offline_paged.worker.block_table_rows import BlockTableRows, MirroredRows
from offline_paged.worker.launched_step import LateSamples, LaunchedStep, ReadySamples
from offline_paged.worker.mirrored_step import BlockMoves, EagerForward, GraphForward, MirroredStep, RowsDiff
from offline_paged.worker.sampler import Sampler, SamplingRequest, log_softmax, top_logprobs
from offline_paged.worker.sampling_rows import SamplingRows
from offline_paged.worker.step_inputs import (DecodeColumns, EagerBatch, StepUpload, decode_columns,
                                              decode_pending_inputs, eager_batch, pack_eager, pending_inputs,
                                              synthetic_prefill, unpack_eager)
from offline_paged.worker.step_report import DeviceTimer

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


class ModelRunner:
    """Owns the device KV pool [L, 2, N, B, Hkv, D] and, through the backend's swapper, the host swap
    pool [L, 2, C, B, Hkv, D] (pinned on CUDA; created on the first swap, so recompute-only runs
    never pin it)."""

    def __init__(self, model, backend, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 sampler: Sampler | None = None, device_sampling: bool | None = None,
                 cuda_graphs: bool = False, max_model_len: int | None = None, mirror=None,
                 max_num_seqs: int = 256, mixed_graph_tokens: int = 0) -> None:
        """device_sampling: sample on the GPU (None: whenever the backend is CUDA; False: on the host with
        `sampler`, the reference; True on the CPU backend is a ValueError).
        cuda_graphs: replay decode-only steps from CUDA graphs (offline_paged/worker/cuda_graph_runner.py) where
        the backend is CUDA and the model float16 or bfloat16; needs max_model_len (the attention's static bound).
        Ignored on the CPU. max_num_seqs: the largest batch, which picks the graphs' batch sizes.
        mixed_graph_tokens: with cuda_graphs, steps that prefill, of up to this many tokens, replay piecewise
        graphs (offline_paged/worker/mixed_graphs.py); 0: they run eagerly. Not with tensor parallelism.
        mirror: tensor parallel, rank 0 only: `mirror.send_step(MirroredStep)` gets every step's
        inputs before the forward (see run_mirrored)."""
        self.model = model
        self.mirror = mirror
        self.backend = backend
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.sampler = sampler or Sampler()
        if device_sampling and backend.name != "cuda":
            raise ValueError(f"device_sampling needs the CUDA backend, not {backend.name!r}")
        self.gpu_sampler = None
        if backend.name == "cuda" and device_sampling is not False:
            from offline_paged.worker.gpu_sampler import GpuSampler

            self.gpu_sampler = GpuSampler(self.sampler.eos_token_ids)
        self.kv_cache = model.allocate_kv_cache(num_gpu_blocks, block_size)  # [L, 2, N, B, Hkv, D]
        self._swapper = None
        self._upload = StepUpload(backend)
        self._pending_upload = StepUpload(backend)  # where a step's pending input ids come from
        max_blocks = 64 if max_model_len is None else -(-max_model_len // block_size)
        self.table_rows = BlockTableRows(block_size, max_blocks=max_blocks)  # rows live across steps
        self.table_rows.track_mirror = mirror is not None  # rank 0 sends the rows' diffs to the other ranks
        self._mirror_rows = None  # ranks > 0: MirroredRows, rank 0's rows kept by its diffs
        self.decode_graphs = None
        self.mixed_graphs = None
        self.sampling_rows = None
        self._mask_thread = None  # a one-thread pool, made on the first late mask fill
        if cuda_graphs and backend.name == "cuda" and np.dtype(model.dtype).name in ("float16", "bfloat16"):
            if max_model_len is None:
                raise ValueError("cuda_graphs needs max_model_len (the static attention bound)")
            from offline_paged.worker.cuda_graph_runner import DecodeGraphs
            from offline_paged.worker.graph_buckets import decode_buckets, mixed_buckets

            self.attach_decode_graphs(DecodeGraphs(model, self.kv_cache, block_size, max_model_len,
                                                   decode_buckets(max_num_seqs)),
                                      sample_in_graph=self.gpu_sampler is not None, num_rows=max_num_seqs)
            if mixed_graph_tokens and mirror is None and model.tp is None:
                from offline_paged.worker.mixed_graphs import MixedGraphs

                self.mixed_graphs = MixedGraphs(model, self.kv_cache, mixed_buckets(mixed_graph_tokens))

    def attach_decode_graphs(self, graphs, sample_in_graph: bool = True, num_rows: int = 64) -> None:
        """Replay decode-only steps through `graphs` (DecodeGraphs' interface: fits, run, run_and_sample),
        which mirror `table_rows` (and, when sampling in the graph, `sampling_rows`: per-row parameters
        for the graph's sampler, rows = table_rows' rows, num_rows of them to start with: when they grow,
        the graphs' sampling graphs are captured again). sample_in_graph=False: the eager sampler
        samples the graph's logits (the reference in tests)."""
        self.decode_graphs = graphs
        self.table_rows.track_changes = True  # the graphs mirror the rows on the device
        self.sampling_rows = SamplingRows(self.sampler.eos_token_ids, num_rows) if sample_in_graph else None

    @property
    def swapper(self):
        """The backend's block swapper (swap_out(device_ids, cpu_ids), swap_in(cpu_ids, device_ids))."""
        if self._swapper is None:
            self._swapper = self.backend.ops.make_swapper(self.kv_cache, self.num_cpu_blocks)
        return self._swapper

    # ----------------------------------------------------------------- one step
    def execute(self, output) -> list[SequenceResult]:
        """Perform the step's block moves, run the forward and sample. One result per scheduled
        sequence, in order (`launch` + `wait`)."""
        return self.launch(output).wait().results

    def launch(self, output, previous: LaunchedStep | None = None, defer_grammar_sampling: bool = False) -> LaunchedStep:
        """Queue the step's block moves, forward and sampling; the sampled ids stay on the device until
        `wait()`. A sequence whose input token is still pending (async scheduling) gets it from
        `previous`, the step that samples it, on the device. RuntimeError if that step is not given.

        One path per mode: a decode-only step that fits a CUDA graph bucket replays it and samples in
        the graph (`_launch_graph_sampled`; with structured-output rows in the graph's masked sampler,
        `_launch_graph_masked`) or with the eager sampler (`_launch_graph`); any other step runs eagerly
        (`_launch_eager`). Each path sends the tensor-parallel ranks their MirroredStep once, right
        before its forward, and stops the forward's timer right after it.
        defer_grammar_sampling: a step with structured-output rows queues its forward only and comes back
        with `sampling_deferred` set; `launch_deferred_sampling` fills the masks and samples once the
        previous step's tokens have advanced the matchers (the forward runs on the device meanwhile)."""
        moves = BlockMoves.of(output)
        self._move_blocks(moves)  # (a late sampling of `previous` reads no KV block)
        self.table_rows.release(output.freed_seq_ids)
        rows = self.table_rows.sync(output.scheduled)  # [S] each sequence's block-table row
        columns = decode_columns(output.scheduled) if output.scheduled and self.decode_graphs is not None else None
        if columns is not None and previous is not None and previous.sample_rows is not None:
            fill = decode_pending_inputs(columns, rows, previous, self._pending_upload)  # the steady state
        else:
            fill = pending_inputs(output.scheduled, previous, self._pending_upload)
        if previous is not None:  # its late sampling reads the graph buffers and sampling rows reused below:
            previous.queue_sampling()  # queued after this host work, which overlaps its mask fill
        if not output.scheduled:
            self._send_mirror(moves, None)
            return LaunchedStep.nothing_run(output)
        # CUDA events around the forward, never inside a capture (DecodeGraphs captures on its own
        # stream); started after the host-side input packing so that they time the device's work.
        timer = DeviceTimer(self.backend.xp) if self.backend.name == "cuda" else None
        grammar = _has_grammar_rows(output.scheduled)
        decode = self._graph_decode(output.scheduled, rows, columns, grammar)
        defer = defer_grammar_sampling and grammar
        if decode is None:
            return self._launch_eager(output, rows, moves, fill, timer, defer)
        if decode.sample_positions is None:
            return self._launch_graph(output, decode, moves, fill, timer, defer)
        if grammar:
            return self._launch_graph_masked(output, decode, moves, fill, timer, defer)
        return self._launch_graph_sampled(output, decode, moves, fill, timer)

    def launch_deferred_sampling(self, launched: LaunchedStep) -> LaunchedStep:
        """The step `launch(..., defer_grammar_sampling=True)` left unsampled, its masks filling from the
        matchers as they are now on the runner's mask thread (llguidance's pool, without the GIL), its
        sampling queued once they are filled: by the next `launch(output, previous=it)` after that step's
        host work, or by reading its samples. So the host processes this step's predecessor and schedules
        the next while the masks fill: the matchers must not be touched until then (the stop checker reads
        the outcomes of tokens fed ahead). Rows of sequences that finished meanwhile are sampled unmasked
        (their token is dropped by the output processor)."""
        logits, offsets, masked_in_graph = launched.deferred_logits
        return self._launch_sampling(launched.output, logits, offsets, launched.forward_timer,
                                     launched.used_cuda_graph, masked_in_graph, late=True)

    def _launch_eager(self, output, rows: np.ndarray, moves: BlockMoves, fill, timer, defer: bool) -> LaunchedStep:
        """Any step (prefill chunks and decodes mixed): the forward from the mixed-step graphs where a bucket
        holds the step, else eager; then the eager sampler."""
        num_tokens = sum(item.num_new_tokens for item in output.scheduled)
        size = None if self.mixed_graphs is None else self.mixed_graphs.bucket_for(num_tokens)
        packed, layout = pack_eager(output.scheduled, self.table_rows, rows, pad_to=size)
        if self.mirror is not None:  # the other ranks rebuild the block tables from their row mirrors
            self._send_mirror(moves, EagerForward(packed[:packed.size - layout.num_table_entries], layout,
                                                  rows, self.table_rows.lens[rows]))
        batch = unpack_eager(packed, layout, self._upload)
        if fill is not None:
            fill(batch.input_ids)
        if timer is not None:
            timer.start()
        if size is None:
            logits = self.model.forward(batch.input_ids, batch.positions, self.kv_cache, batch.meta,
                                        batch.logits_indices)  # [K, V] float32 (device)
        else:
            logits = self.mixed_graphs.run(batch, num_tokens, size)  # [K, V] float32 (device)
        _stop(timer)
        return self._sample_or_defer(output, self._sampler_logits(logits), batch.logits_offsets, timer,
                                     used_graph=size is not None, defer=defer)

    def _launch_graph(self, output, decode: _GraphDecode, moves: BlockMoves, fill, timer, defer: bool) -> LaunchedStep:
        """A decode-only step replayed from its bucket's graph; the eager sampler samples its logits (some
        row needs penalties, logprobs, constraints, a min_tokens ban, a fork or prompt logprobs)."""
        self._send_mirror(moves, decode.mirrored())  # the other ranks replay the same bucket on their row mirrors
        columns = decode.columns
        logits = self.decode_graphs.run(columns.input_ids, columns.positions, decode.rows, columns.writes,
                                        self.table_rows, timer, fill)  # [b, V] float32 (device), row i = sequence i
        _stop(timer)
        return self._sample_or_defer(output, self._sampler_logits(logits), list(range(len(decode.rows))), timer,
                                     used_graph=True, defer=defer)

    def _launch_graph_masked(self, output, decode: _GraphDecode, moves: BlockMoves, fill, timer,
                             defer: bool) -> LaunchedStep:
        """A decode-only step with structured-output rows replayed from its bucket's graph; once their
        masks are filled (now, or deferred) the graph's masked sampler draws every row one token."""
        self._send_mirror(moves, decode.mirrored())
        columns = decode.columns
        logits = self.decode_graphs.run(columns.input_ids, columns.positions, decode.rows, columns.writes,
                                        self.table_rows, timer, fill, decode.sample_positions)  # [b, V] float32
        _stop(timer)
        return self._sample_or_defer(output, logits, list(range(len(decode.rows))), timer, used_graph=True,
                                     defer=defer, masked_in_graph=decode)

    def _launch_graph_sampled(self, output, decode: _GraphDecode, moves: BlockMoves, fill, timer) -> LaunchedStep:
        """A decode-only step replayed from its bucket's graph, which samples too: every row draws one token."""
        self._send_mirror(moves, decode.mirrored())
        columns = decode.columns
        _, samples = self.decode_graphs.run_and_sample(columns.input_ids, columns.positions, decode.rows,
                                                       columns.writes, self.table_rows, decode.sample_positions,
                                                       self.sampling_rows, timer, fill)
        _stop(timer)
        return LaunchedStep(output=output, samples=samples, sample_index=None, sample_rows=decode.rows,
                            sample_seq_ids=columns.seq_ids, owners=None,
                            prompt_logprobs=[None] * len(output.scheduled), forward_timer=timer, used_cuda_graph=True)

    def _graph_decode(self, scheduled, rows: np.ndarray, columns: DecodeColumns | None,
                      grammar: bool) -> _GraphDecode | None:
        """The replay of a decode-only step that fits a CUDA graph bucket; None when the eager forward runs
        (no graphs, some sequence computes more than one token, or no bucket fits). rows [S]: block-table rows;
        columns: decode_columns(scheduled), None without graphs; grammar: some sampled row has a
        structured-output matcher (_has_grammar_rows)."""
        graphs = self.decode_graphs
        if graphs is None:
            return None
        if columns is None:
            return None  # some sequence computes more than one token
        if not graphs.fits(len(scheduled), int(columns.positions.max()) + 1, int(self.table_rows.lens[rows].max())):
            return None
        sample_positions = self._graph_sample_positions(scheduled, rows, columns)
        if sample_positions is not None and grammar and not graphs.masks_fit(_grammar_words(scheduled)):
            sample_positions = None  # masks narrower than the logits: the eager sampler applies them
        return _GraphDecode(columns, rows, sample_positions)

    def _sampler_logits(self, logits):
        """The logits where the sampler reads them: on the device for the GpuSampler, else on the host
        ([K, V] float32: the step's one device->host copy)."""
        return logits if self.gpu_sampler is not None else self.backend.to_host(logits)

    def _graph_sample_positions(self, scheduled, rows: np.ndarray, columns: DecodeColumns) -> np.ndarray | None:
        """[S] output positions to sample in the decode graph, or None when some row needs the eager
        sampler (penalties, logprobs, constraints, a min_tokens ban, a fork, prompt logprobs). Rows are
        repacked in `sampling_rows` only when their sequence changed."""
        if self.sampling_rows is None or not columns.one_sample_each:
            return None

        def describe(i: int):
            seq = scheduled[i].seq
            return seq.group.params, seq.sampling_seed, seq.group.beam is not None

        self.sampling_rows.update(rows, columns.seq_ids, describe)
        sample_positions = columns.sample_positions  # [S]
        return sample_positions if self.sampling_rows.graph_ready(rows, sample_positions) else None

    # ----------------------------------------------------------------- tensor parallel
    def _send_mirror(self, moves: BlockMoves, forward: EagerForward | GraphForward | None) -> None:
        """Rank 0: the step's block moves, the block-table rows' diff since the last step (their shape and
        the entries written) and the forward's compact inputs, to every other rank."""
        if self.mirror is not None:
            diff = RowsDiff(self.table_rows.tables.shape, self.table_rows.take_mirror_changes())
            self.mirror.send_step(MirroredStep(moves, diff, forward))

    def run_mirrored(self, step: MirroredStep) -> None:
        """Tensor-parallel ranks > 0: perform the block moves and the forward rank 0 sent (`_send_mirror`),
        on this rank's shard and KV pool, with the same block ids. The logits are not used: the forward
        runs for its collectives and the K/V it writes. The step's rows diff updates this rank's
        MirroredRows, from which an eager forward's block tables are rebuilt."""
        self._move_blocks(step.moves)
        if self._mirror_rows is None:
            self._mirror_rows = MirroredRows(self.block_size)
            self._mirror_rows.track_changes = self.decode_graphs is not None
        self._mirror_rows.apply(step.rows_diff.table_shape, step.rows_diff.changes)
        forward = step.forward
        if forward is None:
            return
        if isinstance(forward, GraphForward):
            self.decode_graphs.run(forward.input_ids, forward.positions, forward.rows, forward.writes,
                                   self._mirror_rows)
            return
        tables = self._mirror_rows.block_tables(forward.rows, forward.row_lens, forward.layout.table_width)  # [S, M]
        batch = unpack_eager(np.concatenate([forward.inputs_head, tables.ravel()]), forward.layout, self._upload)
        self.model.forward(batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_indices)

    # ----------------------------------------------------------------- block moves
    def _move_blocks(self, moves: BlockMoves) -> None:
        self.swap_out(moves.swap_out)
        self.swap_in(moves.swap_in)
        self.copy_blocks(moves.copies)

    # Block ids stay on the host: the swapper and copy_blocks take host ids, so no move syncs the device.
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            device_ids, cpu_ids = _split_pairs(pairs)
            self.swapper.swap_out(device_ids, cpu_ids)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            cpu_ids, device_ids = _split_pairs(pairs)
            self.swapper.swap_in(cpu_ids, device_ids)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src_ids, dst_ids = _split_pairs(pairs)
            self.backend.ops.copy_blocks(self.kv_cache, np.asarray(src_ids, dtype=np.int64),
                                         np.asarray(dst_ids, dtype=np.int64))

    # ----------------------------------------------------------------- inputs
    def _prepare(self, scheduled, rows: np.ndarray) -> EagerBatch:
        """The eager step's device inputs (step_inputs.eager_batch). rows [S]: rows in `table_rows`."""
        return eager_batch(scheduled, self.table_rows, rows, self._upload)

    # ----------------------------------------------------------------- outputs
    def _sample_or_defer(self, output, logits, offsets: list[int], timer, used_graph: bool, defer: bool,
                         masked_in_graph: _GraphDecode | None = None) -> LaunchedStep:
        """`_launch_sampling` now, or (defer) a LaunchedStep holding the logits for launch_deferred_sampling."""
        if not defer:
            return self._launch_sampling(output, logits, offsets, timer, used_graph, masked_in_graph)
        return LaunchedStep(output=output, samples=None, sample_index={}, owners=[], prompt_logprobs=[],
                            forward_timer=timer, used_cuda_graph=used_graph,
                            deferred_logits=(logits, offsets, masked_in_graph))

    def _launch_sampling(self, output, logits, offsets: list[int], timer, used_graph: bool,
                         masked_in_graph: _GraphDecode | None = None, late: bool = False) -> LaunchedStep:
        """Queue the sampling of every sampled row; prompt logprobs are computed now (on the host).
        logits [K, V]: host, or device when the GpuSampler samples (then prompt-logprob rows are copied
        to the host alone). masked_in_graph: the replay of a decode-graph step whose rows (some with a
        grammar) the graph's masked sampler draws, one token each; its samples are found by their rows, as
        the unmasked graph's are, so the next decode step finds its pending tokens in NumPy. late: the
        structured-output masks fill on the mask thread and the sampling is queued by the returned step's
        LateSamples; else both happen now."""
        scheduled = output.scheduled
        if masked_in_graph is not None:
            server = _mask_server(scheduled) if late else None  # its workers write straight into shared rows
            masks = self.decode_graphs.mask_staging(len(scheduled), _grammar_words(scheduled),
                                                    server and server.shared_rows)  # [S, W] int32
            filled = self._fill_masks(_graph_mask_rows(scheduled, masks), masks, late)

            def draw_in_graph():
                filled()
                return self.decode_graphs.sample_masked(masks, self.sampling_rows)

            samples = LateSamples(draw_in_graph, self.decode_graphs.sampled_ids(len(scheduled)),
                                  _early(server)) if late else draw_in_graph()
            return LaunchedStep(output=output, samples=samples, sample_index=None, sample_rows=masked_in_graph.rows,
                                sample_seq_ids=masked_in_graph.columns.seq_ids, owners=None,
                                prompt_logprobs=[None] * len(scheduled), forward_timer=timer, used_cuda_graph=True)
        rows, owners, sample_index, drawn = [], [], {}, []
        for i, item in enumerate(scheduled):
            if not item.num_samples:
                continue
            row = offsets[i] + (item.num_new_tokens - 1 if item.prompt_logprobs is not None else 0)
            sample_index[item.seq.seq_id] = len(rows)  # the seq's own token: its row's first draw
            rows += [row] * item.num_samples
            owners += [i] * item.num_samples
            drawn.append(i)
        grammar = [i for i in drawn if _needs_mask(scheduled[i])]
        masks = np.empty((len(grammar), _grammar_words(scheduled) if grammar else 0), dtype=np.int32)  # [Rm, W]
        filled = self._fill_masks([(scheduled[i].seq.matcher, j) for j, i in enumerate(grammar)], masks, late)

        def draw():
            filled()
            mask_of = dict(zip(grammar, masks))
            requests = [request for i in drawn for request in _sampling_requests(scheduled[i], mask_of.get(i))]
            if not requests:
                return ReadySamples([])
            if self.gpu_sampler is not None:
                return self.gpu_sampler.sample_async(logits, rows, requests)
            return ReadySamples(self.sampler.sample(logits[rows], requests))

        prompt = [_prompt_logprobs(item, logits, offsets[i], self.backend.to_host) for i, item in enumerate(scheduled)]
        early = late and _early(_mask_server(scheduled) if grammar else None)
        return LaunchedStep(output=output, samples=LateSamples(draw, early=early) if late else draw(),
                            sample_index=sample_index,
                            owners=owners, prompt_logprobs=prompt, forward_timer=timer, used_cuda_graph=used_graph)

    def _fill_masks(self, rows: list, out: np.ndarray, late: bool):
        """Fill the (matcher, row) pairs' next-token masks into `out` now, or (late) in the matchers'
        MaskServer's processes when they have one, else on the runner's mask thread; returns the wait for
        them (a no-op when filled now)."""
        if not rows:
            return _filled
        server = rows[0][0].mask_server
        if late and server is not None:  # worker processes fill them (core/mask_server.py)
            return server.fill(rows, out)
        from offline_paged.core.structured_matcher import fill_bitmask_rows  # llguidance: only where grammars run

        if not late:
            fill_bitmask_rows(rows, out)
            return _filled
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        started = threading.Event()

        def fill() -> None:
            started.set()
            fill_bitmask_rows(rows, out)  # llguidance drops the GIL for the fill

        filled = self._mask_thread.submit(fill).result
        # Wait until the thread runs: a thread waking up to the GIL held by this busy one would wait
        # for the interpreter's switch interval (5 ms), i.e. until this thread blocks in `filled()`.
        started.wait()
        return filled


@dataclass(slots=True, frozen=True)
class _GraphDecode:
    """How a decode-only step replays from a CUDA graph bucket."""

    columns: DecodeColumns
    rows: np.ndarray  # [S] block-table rows
    sample_positions: np.ndarray | None  # [S] output positions the graph samples; None: the eager sampler samples

    def mirrored(self) -> GraphForward:
        """The replay as the other tensor-parallel ranks run it."""
        return GraphForward(self.columns.input_ids, self.columns.positions, self.columns.writes, self.rows)


def _stop(timer) -> None:
    """Stop the forward's DeviceTimer (None on the CPU) right after the forward is queued."""
    if timer is not None:
        timer.stop()


def _sampling_requests(item, token_bitmask=None) -> list[SamplingRequest]:
    """One request per sample drawn from this sequence's row (n of them when it forks: one grammar state,
    one mask, for all of them)."""
    seq = item.seq
    seeds = seq.group.sample_seeds if item.num_samples > 1 else [seq.sampling_seed]
    prompt = _TokenWindow(seq.token_ids, 0, seq.num_prompt_tokens)
    output = _TokenWindow(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids))
    return [SamplingRequest(seq.group.params, seed, item.sample_position, prompt, output, token_bitmask)
            for seed in seeds[:item.num_samples]]


def _has_grammar_rows(scheduled) -> bool:
    return any(item.num_samples and item.seq.matcher is not None for item in scheduled)


def _grammar_words(scheduled) -> int:
    """int32 words of the step's structured-output masks (one grammar tokenizer per engine)."""
    return next(item.seq.matcher.num_words for item in scheduled if item.seq.matcher is not None)


def _mask_server(scheduled):
    """The MaskServer of the step's grammar rows (one per engine), or None: masks fill in this process."""
    return next((item.seq.matcher.mask_server for item in scheduled if item.seq.matcher is not None), None)


def _early(server) -> bool:
    """Whether a late sampling whose masks `server` fills (None: this process) is queued early."""
    return server is not None and server.queue_sampling_early


def _needs_mask(item) -> bool:
    """A sampled sequence with a grammar; one that finished meanwhile (async scheduling ran it one step
    ahead; its token is dropped), or whose matcher refused its last token (it ends with an error), needs none."""
    matcher = item.seq.matcher
    return bool(item.num_samples) and matcher is not None and not item.seq.is_finished and not matcher.is_failed


def _graph_mask_rows(scheduled, masks: np.ndarray) -> list:
    """The (matcher, row) pairs to fill into masks [S, W]; every other row is set to all bits (no constraint)."""
    rows = []
    for i, item in enumerate(scheduled):  # (_needs_mask inlined: 256 rows a step on the JSON bench's hot path)
        seq = item.seq
        matcher = seq.matcher
        if item.num_samples and matcher is not None and not seq.is_finished and not matcher.is_failed:
            rows.append((matcher, i))
        else:
            masks[i] = -1
    return rows


def _filled() -> None:
    """The wait of masks filled at once."""


class _TokenWindow(Sequence):
    """token_ids[start:stop] without the copy: most sampling rows only ask for its length (min_tokens);
    penalties iterate it. Valid until the sequence changes, i.e. for the step it was made in."""

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, token_ids: list[int], start: int, stop: int) -> None:
        self._ids, self._start, self._stop = token_ids, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[self._start:self._stop][index]
        if not -len(self) <= index < len(self):
            raise IndexError("token window index out of range")
        return self._ids[self._start + index % len(self)]

    def __iter__(self):
        return itertools.islice(self._ids, self._start, self._stop)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self._ids[self._start:self._stop], dtype=dtype)


def _prompt_logprobs(item, logits, offset: int, to_host) -> list[dict[int, float]] | None:
    """Entries for prompt positions start+1 ... (the row at position q scores token q+1)."""
    if item.prompt_logprobs is None:
        return None
    seq = item.seq
    last = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
    num_rows = max(last - item.start, 0)
    if num_rows == 0:
        return []
    scores = log_softmax(to_host(logits[offset:offset + num_rows]))  # [num_rows, V] float64
    targets = seq.token_ids[item.start + 1:item.start + 1 + num_rows]
    return [top_logprobs(row, item.prompt_logprobs, chosen=t) for row, t in zip(scores, targets)]


def _split_pairs(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]


def profile_step_memory(model, backend, num_tokens: int, num_seqs: int, block_size: int,
                        eos_token_ids=()) -> int:
    """Bytes of device memory the largest step needs beyond the weights and the KV pool (CUDA only).

    Runs one dummy prefill of `num_tokens` tokens spread over `num_seqs` sequences (the token and
    sequence budgets of a step) against a scratch KV cache just big enough for it, then samples every
    sequence's last row on the device with top-p (top_cut and the race over an [S, V] float64 copy). CuPy's pool
    keeps freed blocks, so its growth over the step plus the free bytes it held at the start (which the
    step may have reused) bounds the step's high-water mark from above. The pool is emptied first, but
    free_all_blocks keeps split blocks, so in a process that ran other work the bound is loose (safe).
    """
    from offline_paged.worker.gpu_sampler import GpuSampler
    from offline_paged.worker.sampler import SamplingRequest
    from offline_paged.core.sampling_params import SamplingParams

    xp = backend.xp
    step = synthetic_prefill(num_tokens, num_seqs, block_size)
    lens, num_seqs = step["lens"], step["lens"].size
    pool = xp.get_default_memory_pool()
    xp.cuda.Device().synchronize()
    pool.free_all_blocks()
    kv_cache = model.allocate_kv_cache(step["num_blocks"], block_size)  # [L, 2, N, B, Hkv, D]
    meta = AttentionMetadata(
        slot_mapping=backend.int32(step["slots"]), block_tables=backend.int32(step["tables"]),
        context_lens=backend.int32(lens), query_start_loc=backend.int32(step["query_start_loc"]),
        max_query_len=int(lens.max()), max_context_len=int(lens.max()))
    before, reusable = pool.total_bytes(), pool.free_bytes()
    with model.kv_scales_held():  # dummy tokens must not set calculated FP8 KV scales
        logits = model.forward(backend.int32(np.zeros(num_tokens)), backend.int32(step["positions"]), kv_cache,
                               meta, backend.int32(step["query_start_loc"][1:] - 1))  # [S, V] float32
    params = SamplingParams(temperature=1.0, top_p=0.9)
    requests = [SamplingRequest(params, i, 0, (0,), ()) for i in range(num_seqs)]
    GpuSampler(eos_token_ids).sample(logits, list(range(num_seqs)), requests)
    xp.cuda.Device().synchronize()
    peak = pool.total_bytes() - before + reusable
    del logits, kv_cache, meta
    pool.free_all_blocks()
    return int(peak)


def kv_block_bytes(model_config, block_size: int, dtype) -> int:
    """Bytes of one KV block across all layers, K and V, in the pool's element type `dtype` (1 byte an
    element for the FP8 KV cache, so the same memory holds 2x the blocks of a 16-bit pool)."""
    c = model_config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
    return per_token * block_size * np.dtype(dtype).itemsize
