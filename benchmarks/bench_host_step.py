"""Host time per engine step on the GPU code path, measured on the CPU: the forward and the device
sampler's kernels are stubbed out, so what is timed is the Python the GPU path runs every step
(schedule, input packing, the device sampler's host-side packing and unpacking, postprocess, stats).

    python benchmarks/bench_host_step.py [--num-requests 256] [--output-len 128] [--graphs] [--profile]
                                         [--repeat 3] [--clock wall|cpu] [--max-num-seqs 256]
                                         [--dataset nano-vllm|sharegpt-like]
                                         [--gc paced|default]
                                         [--job ids|chat [--tokenizer-dir DIR]]
                                         [--structured json --mask-processes K]
                                         [--swap-from REF --swap MODULE.CLASS.METHOD ...]

The workload is the `bench` random one scaled down in output length: prompts 100..1024, every request
decodes exactly --output-len tokens, max_num_batched_tokens 8192, so most steps are 256-sequence
decodes like the H200 run's. Prints mean ms per step for the whole step and for each part.
--dataset sharegpt-like takes the bench's log-normal lengths instead (short outputs: prompts keep arriving beside
the decodes, as in a large job's steady state); --max-num-seqs sets the batch cap (the stand-in graphs' buckets
follow it, as the engine's do).
The loop runs with the collector paced as the engine's step loops run it (offline_paged/core/gc_pacing.py; --gc default:
the interpreter's thresholds); "gc pauses" is the collector's time in the loop, "(full)" its oldest generation's.
--job runs the workload as `generate` lines through its JobRunner instead of adding the requests up front, so the
job's own host work in the step loop is timed too: "lines in" (parse, chat template, tokenizer, add_request) and
"records out". --job chat sends each prompt as a user message of as many common words (the chat template and the
tokenizer of --tokenizer-dir run for each line); --job ids sends the prompt's token ids.
The engine schedules asynchronously, as on the GPU (--sync: the synchronous loop, the CPU default).
--repeat N runs the whole workload N times (a fresh engine each) and prints each figure's median over the
runs; --clock cpu times with this thread's CPU clock instead of the wall clock, which a shared, busy host
disturbs less (time the process spends waiting for a core is not counted).
--graphs times the CUDA-graph decode path instead (the GPU bench's default): decode steps go through a
HostOnlyDecodeGraphs that does DecodeGraphs' host part (the five-int-per-slot pack, the block-table change
feed, the dirty sampling rows) and samples in the "graph" (no eager sampler packing on those steps); its
samples are unpacked by gpu_sampler._results, as PendingSamples.of_graph's are.
--structured json constrains every request by the bench's JSON schema (the engine's async grammar path: feed
the matchers ahead, dispatch the mask fill to --mask-processes worker processes, read their outcomes, sample
masked in the "graph"). The stand-in samplers draw a random allowed token from each row's mask; that draw
is not engine work, so it is timed apart ("stub token draw") and left out of "engine step". "tokens -> masked
sampling queued" is the step loop's part of the JSON step's cycle: from a step's tokens reaching the host to the
queueing of the next step's masked sampling (on the device the forward must outlast it).
--swap-from REF --swap offline_paged.core.scheduler.Scheduler._schedule (repeatable) measures a host change
against git revision REF in one process: once every prompt is in, a seeded coin gives each step REF's version of
each named method (its module loaded from `git show`) or this tree's, and each figure is printed for both sides
("tree" / "ref"), per step of that side; the prefill steps before are left out. (With --structured the stub
draw is then not split out: both sides include it.) Separate runs on a shared 2-core machine spread by +-30%;
steps interleaved in one process see the same machine.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import cProfile
import gc
import io
import json
import importlib
import importlib.util
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
import types

import numpy as np

from offline_paged.benchmark.bench import (STRUCTURED_KINDS, random_workload, sharegpt_like_workload,
                                           structured_workload)
from offline_paged.core import gc_pacing
from offline_paged.core.config import EngineConfig
from offline_paged.core.outputs import RequestError
from offline_paged.engine import LLMEngine
from offline_paged.job.job_file import JsonlWriter
from offline_paged.job.job_runner import JobRunner
from offline_paged.models.dummy_weights import dummy_model, preset_config, random_weights
from offline_paged.models.loader import LoadedModel, load_tokenizer
from offline_paged.worker.graph_buckets import DECODE_BUCKETS, decode_buckets
from offline_paged.worker.launched_step import ReadySamples
from offline_paged.worker.sampler import SampleResult


def _gpu_sampler_host_part():
    """offline_paged.worker.gpu_sampler imported over a numpy stand-in for cupy and no-op kernels, so its
    host-side packing (_upload) and unpacking (_results) run for real."""
    fake_cupy = types.ModuleType("cupy")
    for name in ("asarray", "empty", "zeros", "full", "float64", "float32", "int32", "ascontiguousarray"):
        setattr(fake_cupy, name, getattr(np, name))
    fake_kernels = types.ModuleType("offline_paged.ops.sampling_launcher")
    fake_kernels.PARAMS_WIDTH = 8
    saved = {k: sys.modules.get(k) for k in ("cupy", "offline_paged.ops.sampling_launcher")}
    sys.modules["cupy"] = fake_cupy
    sys.modules["offline_paged.ops.sampling_launcher"] = fake_kernels
    import offline_paged.ops as ops_pkg

    ops_pkg.sampling_launcher = fake_kernels
    try:
        import offline_paged.worker.gpu_sampler as gpu_sampler
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module
    return gpu_sampler


class TokenDraw:
    """The stand-in for the device's sampling under a grammar: a random allowed token per mask row (EOS only
    where nothing else is allowed), timed so that the report can leave it out."""

    def __init__(self, vocab: int, eos: int, clock) -> None:
        self.vocab, self.eos, self.clock = vocab, eos, clock
        self.rng = np.random.default_rng(0)
        self.seconds = 0.0

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        """masks [R, W] int32 -> [R] int32 token ids."""
        start = self.clock()
        bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=1, bitorder="little")[:, :self.vocab]
        others = bits.copy()
        others[:, self.eos] = 0
        bits = np.where(others.any(axis=1, keepdims=True), others, bits).astype(np.float64)  # [R, V]
        scores = self.rng.random(bits.shape) * bits
        tokens = scores.argmax(axis=1).astype(np.int32)
        self.seconds += self.clock() - start
        return tokens


class HostOnlySampler:
    """GpuSampler.sample with the kernels removed: upload packing, then results from a zeroed download
    (rows with a grammar mask draw an allowed token, `TokenDraw`)."""

    def __init__(self, gpu_sampler, draw: TokenDraw | None = None) -> None:
        self._mod = gpu_sampler
        self._draw = draw

    def sample_async(self, logits, rows, requests):
        return ReadySamples(self.sample(logits, rows, requests))

    def sample(self, logits, rows, requests) -> list[SampleResult]:
        mod = self._mod
        mod._upload(requests, rows, logits.shape[1], (1,))
        top_ks = mod._top_ks(requests, logits.shape[1])
        asking = np.flatnonzero(top_ks)
        k_max = int(top_ks.max())
        host = np.full(2 * len(requests) + 2 * asking.size * k_max, 7.0)  # token 7, logprob 7.0
        host[1::2][:len(requests)] = -1.0
        masked = [i for i, r in enumerate(requests) if r.token_bitmask is not None]
        if masked:
            host[0::2][masked] = self._draw(np.stack([requests[i].token_bitmask for i in masked]))
        wants = [r.params.logprobs is not None for r in requests]
        return mod._results(host, top_ks, asking, k_max, wants, [False] * len(requests))


class HostOnlyGraphSamples:
    """PendingSamples.of_graph's host part: results() unpacks a downloaded [S, 2] (token 7, logprob -1.0)
    with gpu_sampler._results, as on the device."""

    def __init__(self, gpu_sampler, num_seqs: int, token_ids: np.ndarray | None = None) -> None:
        self._mod, self._num_seqs = gpu_sampler, num_seqs
        self.token_ids = np.full(num_seqs, 7, dtype=np.int32) if token_ids is None else token_ids  # [S]

    def results(self) -> list[SampleResult]:
        host = np.tile(np.array([7.0, -1.0]), self._num_seqs)  # [S * 2] float64 (token id, logprob)
        host[0::2] = self.token_ids
        num_seqs = self._num_seqs
        return self._mod._results(host, np.zeros(num_seqs, np.int64), np.zeros(0, np.int64), 0,
                                  [False] * num_seqs, [False] * num_seqs)


class HostOnlyDecodeGraphs:
    """DecodeGraphs' host-side work per replay, without a device (cuda_graph_runner.py: _Bucket.pack,
    _sync_tables, _sync_rows); logits are zeros and every graph-sampled token is 7."""

    def __init__(self, vocab: int, block_size: int, max_model_len: int, gpu_sampler, draw: TokenDraw | None = None,
                 buckets: tuple[int, ...] = DECODE_BUCKETS) -> None:
        self.buckets = buckets
        self.gpu_sampler = gpu_sampler
        self.vocab, self.max_model_len = vocab, max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self._hosts = {b: np.zeros(5 * b, dtype=np.int32) for b in self.buckets}
        self._draw = draw
        self._staging: list = [(None, np.zeros((0, 0), np.int32))] * 2  # (source, rows), used in turn
        self._next_staging = 0
        self._last_run = 0  # slots of the last replay
        self.largest_replay = 0  # sequences in the largest step replayed

    def masks_fit(self, num_words: int) -> bool:
        return 32 * num_words >= self.vocab

    def mask_staging(self, num_seqs: int, num_words: int, host_rows=None) -> np.ndarray:
        """DecodeGraphs.mask_staging without the pinning."""
        index, self._next_staging = self._next_staging, 1 - self._next_staging
        source, staging = self._staging[index]
        if staging.shape[1] != num_words or staging.shape[0] < num_seqs or source != host_rows:
            shape = (max(num_seqs, self.buckets[-1]), num_words)
            staging = np.zeros(shape, np.int32) if host_rows is None else host_rows(*shape)
            self._staging[index] = (host_rows, staging)
        return staging[:num_seqs]

    def sample_masked(self, masks: np.ndarray, sampling_rows):
        """DecodeGraphs.sample_masked's host part (the dirty sampling rows), then the stand-in draw."""
        if masks.shape[0] != self._last_run:
            raise ValueError(f"masks for {masks.shape[0]} slots after a replay of {self._last_run}")
        _sync_rows(sampling_rows)
        return HostOnlyGraphSamples(self.gpu_sampler, masks.shape[0], self._draw(masks))

    def sampled_ids(self, num_seqs: int) -> np.ndarray:
        return np.zeros(num_seqs, np.int32)  # [S] (the "device" ids the next step's pending inputs read)

    def fits(self, num_seqs: int, max_context_len: int, max_table_len: int) -> bool:
        return (0 < num_seqs <= self.buckets[-1] and max_context_len <= self.max_model_len
                and max_table_len <= self.max_blocks)

    def run(self, input_ids, positions, slot_rows, writes, table_rows, timer=None, fill=None, sample_positions=None):
        num_seqs = len(slot_rows)
        size = next(b for b in self.buckets if b >= num_seqs)
        host = self._hosts[size]
        ids, rows, sample_pos, pos, write = (host[i * size:(i + 1) * size] for i in range(5))
        ids[:num_seqs], ids[num_seqs:] = input_ids, 0
        rows[:num_seqs], rows[num_seqs:] = slot_rows, -1
        sample_pos[:num_seqs], sample_pos[num_seqs:] = 0 if sample_positions is None else sample_positions, 0
        pos[:num_seqs], pos[num_seqs:] = positions, 0
        write[:num_seqs], write[num_seqs:] = writes, 0
        table_rows.take_changes()
        self._last_run = num_seqs
        self.largest_replay = max(self.largest_replay, num_seqs)
        return np.zeros((size, self.vocab), dtype=np.float32)  # [b, V]

    def run_and_sample(self, input_ids, positions, slot_rows, writes, table_rows, sample_positions, sampling_rows,
                       timer=None, fill=None):
        _sync_rows(sampling_rows)
        logits = self.run(input_ids, positions, slot_rows, writes, table_rows, timer, fill, sample_positions)
        return logits, HostOnlyGraphSamples(self.gpu_sampler, len(slot_rows))


def _sync_rows(sampling_rows) -> None:
    """DecodeGraphs._sync_rows' host part: the dirty sampling rows packed for their upload."""
    dirty = sampling_rows.take_dirty()
    if dirty.size:
        np.concatenate([dirty.astype(np.uint64), sampling_rows.seeds[dirty],
                        sampling_rows.params[dirty].ravel().view(np.uint64)])


def build_engine(num_requests: int, graphs: bool = False, async_scheduling: bool = True,
                 mask_processes: int = 0, draw: TokenDraw | None = None, max_num_seqs: int = 256,
                 tokenizer=None):
    """The engine with the stand-ins; `tokenizer` (a real one, for --job chat) gives the model its vocabulary."""
    tiny = dummy_model("tiny")  # 2 layers, hidden 64: the host's share of a step is what is measured
    model = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, max_position_embeddings=4096))
    if tokenizer is not None:
        shape = dataclasses.replace(model.config, vocab_size=tokenizer.vocab_size,
                                    eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)))
        model = LoadedModel(shape, random_weights(shape), tokenizer, "tiny shape, a real tokenizer")
    config = EngineConfig(device="cpu", num_kv_blocks=num_requests * 2200 // 16 + 64, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=8192, max_model_len=4096, async_scheduling=async_scheduling,
                          grammar_mask_processes=mask_processes,
                          admission_batch=max(1, max_num_seqs // 8))  # CUDA's default (the CPU's is 1)
    engine = LLMEngine(config, loaded_model=model)
    runner = engine.runner
    vocab = model.config.vocab_size

    def forward(input_ids, positions, kv_cache, meta, logits_indices):
        return np.zeros((len(logits_indices), vocab), dtype=np.float32)  # [K, V]

    runner.model.forward = forward
    gpu_sampler = _gpu_sampler_host_part()
    runner.gpu_sampler = HostOnlySampler(gpu_sampler, draw)
    if graphs:
        runner.attach_decode_graphs(HostOnlyDecodeGraphs(vocab, config.block_size, config.max_model_len,
                                                         gpu_sampler, draw, decode_buckets(max_num_seqs)),
                                    num_rows=max_num_seqs)
    return engine


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


@contextlib.contextmanager
def timed_collections(timer: "Timer"):
    """The cyclic collector's pauses inside the block, added to `timer` as "gc pauses" (every generation)
    and "gc pauses (full)" (the oldest), by the wall clock whatever --clock says: a pause holds the host."""
    started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        pause = time.perf_counter() - started[0]
        timer.add("gc pauses", pause)
        if info["generation"] == 2:
            timer.add("gc pauses (full)", pause)

    gc.callbacks.append(on_collection)
    try:
        yield
    finally:
        gc.callbacks.remove(on_collection)


class Timer:
    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, float] = {}
        self.suffix = ""  # " (tree)" / " (ref)" while --swap alternates the steps

    def add(self, label: str, seconds: float) -> None:
        label += self.suffix
        self.totals[label] = self.totals.get(label, 0.0) + seconds

    def wrap(self, obj, name: str, label: str) -> None:
        original, clock = getattr(obj, name), self.clock

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(label, clock() - t0)

        setattr(obj, name, timed)


@contextlib.contextmanager
def time_the_sampling_cycle(timer: Timer):
    """"tokens -> masked sampling queued": from a step's tokens reaching the host (the first return of its
    `LaunchedStep.wait`) to the queueing of the next step's late (masked) sampling. On the device the step loop
    must do this within the forward, or the device idles (benchmarks/NOTES.md, session 51's cycle)."""
    from offline_paged.worker.launched_step import LateSamples, LaunchedStep

    tokens_at = {"step": None, "time": None}
    waited, launch = LaunchedStep.wait, LateSamples.launch

    def wait(step):
        done = waited(step)
        if tokens_at["step"] is not step:
            tokens_at.update(step=step, time=timer.clock())
        return done

    def queue(samples):
        if not samples.launched and tokens_at["time"] is not None:
            timer.add("tokens -> masked sampling queued", timer.clock() - tokens_at["time"])
            tokens_at["time"] = None
        return launch(samples)

    LaunchedStep.wait, LateSamples.launch = wait, queue  # (the classes': every step's instances)
    try:
        yield
    finally:
        LaunchedStep.wait, LateSamples.launch = waited, launch


def load_swaps(ref: str, specs: list[str]) -> list[tuple[type, str, object, object]]:
    """(class, method name, this tree's function, REF's function) for each MODULE.CLASS.METHOD of specs; REF's
    module is read with `git show` and loaded under a name of its own (its imports are this tree's)."""
    swaps, loaded = [], {}
    for spec in specs:
        module_name, class_name, method = spec.rsplit(".", 2)
        if module_name not in loaded:
            path = importlib.import_module(module_name).__file__
            git = dict(capture_output=True, text=True, check=True, cwd=os.path.dirname(path))
            relative = subprocess.run(["git", "ls-files", "--full-name", path], **git).stdout.strip()
            source = subprocess.run(["git", "show", f"{ref}:{relative}"], **git)
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"_ref_{module_name}", None))
            sys.modules[module.__name__] = module  # (dataclasses look their module up)
            exec(compile(source.stdout, f"{ref}:{relative}", "exec"), module.__dict__)  # noqa: S102 - our own file
            loaded[module_name] = module
        cls = getattr(importlib.import_module(module_name), class_name)
        swaps.append((cls, method, cls.__dict__[method], getattr(loaded[module_name], class_name).__dict__[method]))
    return swaps


def run_once(args, profiler: cProfile.Profile | None = None) -> tuple[int, dict[str, float]]:
    """(steps, {label: seconds}) of one pass over the workload: "whole step" and each timed part."""
    clock = CLOCKS[args.clock]
    tiny = preset_config("tiny")  # build_engine's model
    draw = TokenDraw(tiny.vocab_size, tiny.eos_token_ids[0], clock)
    tokenizer = load_tokenizer(args.tokenizer_dir)[1] if args.job == "chat" else None
    engine = build_engine(args.num_requests, args.graphs, async_scheduling=not args.sync,
                          mask_processes=args.mask_processes, draw=draw, max_num_seqs=args.max_num_seqs,
                          tokenizer=tokenizer)
    timer = Timer(clock)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "_prepare", "runner._prepare")
    timer.wrap(engine.runner, "launch", "runner.launch")
    timer.wrap(engine.runner.gpu_sampler, "sample", "gpu_sampler host part")
    timer.wrap(engine, "_process", "engine._process")  # wait() + postprocess + stats + finished outputs
    timer.wrap(engine.output_processor, "process", "postprocess")
    timer.wrap(engine._stats, "record_schedule", "stats.record_schedule")
    if args.structured:
        timer.wrap(engine.stop_checker, "feed_matchers_ahead", "feed matchers ahead")
        timer.wrap(engine.executor, "launch_deferred_sampling", "mask dispatch")
        timer.wrap(engine.output_processor, "_settle", "outcomes settled")
    if args.dataset == "sharegpt-like":
        requests = sharegpt_like_workload(args.num_requests, vocab_size=200)
    else:
        requests = random_workload(args.num_requests, output_len=(args.output_len,) * 2, vocab_size=200)
    if args.job:
        return run_job(args, engine, requests, timer, profiler)
    if args.structured:
        requests = structured_workload(requests, args.structured)
    for index, request in enumerate(requests):
        engine.add_request(f"r{index}", prompt_token_ids=[t + 4 for t in request.prompt_token_ids],
                           params=request.params)
    if args.structured:  # compile before the timing, as the bench does
        engine.step()
        if engine.mask_server is not None:  # (made with the first grammar)
            engine.mask_server.wait_ready()
            timer.wrap(engine.mask_server, "fill", "mask server fill")
    num_steps, start, drawn = 0, clock(), draw.seconds
    if profiler:
        profiler.enable()
    failed = []
    swaps = load_swaps(args.swap_from, args.swap) if args.swap else []
    coin, swapping = random.Random(0), False
    pacing = gc_pacing.paced() if args.gc == "paced" else contextlib.nullcontext()
    cycle = time_the_sampling_cycle(timer) if args.structured else contextlib.nullcontext()
    try:
        with pacing, timed_collections(timer), cycle:
            while engine.has_unfinished_requests():
                # With --swap, once every prompt is in (the prefill steps, few and long, would weigh on whichever
                # side drew them), a seeded coin picks each step's side (a fixed alternation would meet periodic
                # work in step).
                swapping = swapping or bool(swaps) and not engine.scheduler.waiting and all(
                    len(seq.token_ids) > seq.num_prompt_tokens for seq in engine.scheduler.running)
                if swapping:
                    use_ref = coin.random() < 0.5
                    timer.suffix = " (ref)" if use_ref else " (tree)"
                    timer.add("steps", 1.0)
                    for cls, method, tree_fn, ref_fn in swaps:
                        setattr(cls, method, ref_fn if use_ref else tree_fn)
                    t0 = clock()
                elif swaps:
                    timer.suffix = " (warm-up)"
                    for cls, method, tree_fn, _ in swaps:
                        setattr(cls, method, tree_fn)
                failed += [out for out in engine.step() if isinstance(out, RequestError)]
                engine.stats  # the bench probe snapshots the stats every step
                if swapping:
                    timer.add("whole step", clock() - t0)
                num_steps += 1
    finally:
        if profiler:
            profiler.disable()
        for cls, method, tree_fn, _ in swaps:
            setattr(cls, method, tree_fn)
    if failed:  # a stand-in that draws refused tokens measures error paths, not the engine's step
        raise RuntimeError(f"{len(failed)} requests ended with an error, e.g. {failed[0].message}")
    whole, drawn = clock() - start, draw.seconds - drawn
    totals = {} if swaps else {"whole step": whole}
    if args.structured and not swaps:
        totals.update({"stub token draw": drawn, "engine step": whole - drawn})
        if engine.mask_server is not None:  # (wall clock, whatever --clock says: waits use no CPU)
            waits = engine.mask_server.stats()
            totals["mask server waits (wall)"] = waits["outcome_wait_s"] + waits["mask_wait_s"]
    engine.close()
    return num_steps, {**totals, **timer.totals}


# Common English words, one BPE token each (with their leading space) in the usual vocabularies: a chat line's
# message of n of them tokenises to about n tokens.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her one all we can there been if more when will would who so no").split()


def job_lines(requests: list, kind: str) -> list[str]:
    """The workload as `generate` input lines: the prompt's ids ("ids"), or one user message of as many words as
    the prompt has tokens ("chat": the chat template and the tokenizer run for each line)."""
    rng = random.Random(0)
    lines = []
    for index, request in enumerate(requests):
        fields = {"max_tokens": request.params.max_tokens, "min_tokens": request.params.min_tokens,
                  "ignore_eos": True}
        if kind == "chat":
            words = " ".join(rng.choice(WORDS) for _ in request.prompt_token_ids)
            fields["messages"] = [{"role": "user", "content": words}]
        else:
            fields["prompt_token_ids"] = [t + 4 for t in request.prompt_token_ids]
        lines.append(json.dumps({"id": f"r{index}", **fields}))
    return lines


def run_job(args, engine, requests: list, timer: Timer,
            profiler: cProfile.Profile | None = None) -> tuple[int, dict[str, float]]:
    """The workload through `generate`'s JobRunner (records into memory): the job's own host work per step
    (lines in: parse, chat template, tokenizer, add_request; records out) beside the engine's."""
    lines = job_lines(requests, args.job)
    job = JobRunner(engine, JsonlWriter(io.BytesIO()))
    timer.wrap(job, "_fill", "job: lines in")
    timer.wrap(job, "_finish", "job: records out")
    timer.wrap(engine, "step", "engine.step")
    start = timer.clock()
    profiling = profiler or contextlib.nullcontext()  # a Profile is a context manager that enables it
    with profiling, timed_collections(timer):
        summary = job.run(lines)
    whole = timer.clock() - start
    if summary.num_failed:
        raise RuntimeError(f"{summary.num_failed} lines failed")
    num_steps = engine.stats.num_steps
    engine.close()
    return num_steps, {"whole step": whole, **timer.totals}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (sys.argv's when argv is None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dataset", choices=("nano-vllm", "sharegpt-like"), default="nano-vllm",
                        help="sharegpt-like: the bench's log-normal lengths (--output-len ignored), whose short "
                             "outputs keep prompts arriving beside the decodes")
    parser.add_argument("--job", choices=("ids", "chat"), default=None,
                        help="run the workload as `generate` lines through the JobRunner: prompt ids, or chat "
                             "messages (needs --tokenizer-dir); the job paces the collector itself")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="a model directory whose tokenizer and chat template --job chat uses (e.g. the "
                             "default model's, ~/.cache/offline-paged/SmolLM2-135M-Instruct)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="sequences in one step at most (the host's share grows with the batch)")
    parser.add_argument("--graphs", action="store_true", help="time the CUDA-graph decode path's host part")
    parser.add_argument("--gc", choices=("paced", "default"), default="paced",
                        help="the collector's thresholds in the loop: paced as the engine's step loops run it "
                             "(offline_paged.core.gc_pacing), or the interpreter's own")
    parser.add_argument("--profile", action="store_true",
                        help="print the top of a cProfile by own time (env PROFILE_SORT, PROFILE_TOP: another pstats "
                             "order, more lines)")
    parser.add_argument("--sync", action="store_true",
                        help="the synchronous loop (the CPU engine's default); by default the engine schedules "
                             "asynchronously, as on the GPU (decode inputs pending, results processed a step late)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole workload; medians are printed")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: perf_counter; cpu: this thread's CPU time")
    parser.add_argument("--structured", choices=sorted(STRUCTURED_KINDS), default=None,
                        help="constrain every request like `bench --structured` (with --graphs: the graph's masked path)")
    parser.add_argument("--mask-processes", type=int, default=0,
                        help="grammar mask worker processes (EngineConfig.grammar_mask_processes)")
    parser.add_argument("--swap-from", default=None,
                        help="git revision whose --swap methods a seeded coin's half of the steady steps runs")
    parser.add_argument("--swap", action="append", default=[], metavar="MODULE.CLASS.METHOD",
                        help="a method to take from --swap-from (repeatable)")
    args = parser.parse_args(argv)
    if bool(args.swap) != bool(args.swap_from):
        parser.error("--swap and --swap-from go together")
    if args.job and (args.swap or args.structured):
        parser.error("--job runs without --swap and --structured")
    if (args.job == "chat") != bool(args.tokenizer_dir):
        parser.error("--job chat and --tokenizer-dir go together")
    return args


def main() -> None:
    args = parse_args()
    profiler = cProfile.Profile() if args.profile else None
    runs = [run_once(args, profiler) for _ in range(args.repeat)]
    num_steps = runs[0][0]
    lengths = "sharegpt-like lengths" if args.dataset == "sharegpt-like" else f"x {args.output_len} output tokens"
    print(f"{num_steps} steps, {args.num_requests} requests {lengths}, max_num_seqs {args.max_num_seqs}, "
          f"{args.clock} clock, median of {args.repeat} run(s)")
    for label in sorted(runs[0][1]) if args.swap else runs[0][1]:
        side = next((side for side in ("(tree)", "(ref)") if label.endswith(side)), None)  # its steps: the side's
        if label.startswith("steps") or args.swap and side is None:  # (with --swap: the warm-up's are left out)
            continue
        per_step = sorted(1e3 * totals.get(label, 0.0) / (totals[f"steps {side}"] if side else steps)
                          for steps, totals in runs)
        print(f"{label:<31}{statistics.median(per_step):8.3f} ms")
    if profiler:
        order, lines = os.environ.get("PROFILE_SORT", "tottime"), int(os.environ.get("PROFILE_TOP", "25"))
        pstats.Stats(profiler).sort_stats(order).print_stats(lines)


if __name__ == "__main__":
    main()
