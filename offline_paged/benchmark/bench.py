"""Throughput benchmark: a workload of requests through one LLMEngine, timed step by step.

What one run measures (a `BenchResult`): wall time and tokens/s; per step, the wall time of
`Scheduler.schedule`, of `ModelRunner.execute` (inputs, forward, the logits copy, sampling) and of
the forward on the device (CUDA events the runner records around the forward or graph replay); KV
blocks held and token slots filled; the batch size; device memory in use. All of it comes from the
StepReport that `LLMEngine.step_with_report` returns: nothing in the engine is wrapped or patched.

The roofline estimate counts, per step, the bytes the step must move at least (every weight once,
the K/V of every context token once, the new K/V, the fp32 logits) and the FLOPs it must do (the
matmuls, attention, the LM head), and divides by the copy bandwidth and matmul rate measured in the
same process (`measure_ceilings`). The floor of a step is the larger of the two times; the sum over
steps is the fastest the workload could run on this device with this schedule. Under tensor
parallelism of N each GPU moves and computes 1/N of it at the same time, so the floor is divided by N
(the all-reduces are not counted: the floor stays a lower bound).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from offline_paged.benchmark.host_load import LoadSnapshot, over_run
from offline_paged.core import gc_pacing
from offline_paged.core.outputs import RequestError
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.structured_outputs import StructuredOutputsParams

# `bench --structured json`: every request constrained by this schema. Random weights still write valid JSON
# under it; its free strings and open arrays let outputs run to their drawn length like the plain run's.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "label": {"enum": ["positive", "negative", "neutral"]},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                           "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "score", "tags"]}},
    },
    "required": ["id", "label", "items"],
}
STRUCTURED_KINDS = {"json": StructuredOutputsParams(json=BENCH_SCHEMA)}


# --------------------------------------------------------------------------------- workloads
@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    line: int | None = None  # its line in a --workload file (for error messages)


def parse_length_range(text: str) -> tuple[int, int]:
    """"100:1024" -> (100, 1024); "512" -> (512, 512). ValueError for anything else."""
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or high is None or low < 1 or high < low:
        raise ValueError(f"{text!r} is not a length range like 100:1024 (1 <= low <= high) or 512")
    return low, high


def random_workload(num_requests: int = 256, input_len: tuple[int, int] = (100, 1024),
                    output_len: tuple[int, int] = (100, 1024), vocab_size: int = 32000,
                    seed: int = 0, temperature: float = 1.0) -> list[BenchRequest]:
    """`num_requests` prompts of random token ids; prompt and output lengths uniform in the
    (inclusive) ranges; `ignore_eos` with min_tokens = max_tokens, so every output has exactly
    its drawn length. Same arguments, same workload."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    for name, (low, high) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {low}:{high}")
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))]
        num_out = rng.randint(*output_len)
        params = SamplingParams(max_tokens=num_out, min_tokens=num_out, ignore_eos=True,
                                temperature=temperature, seed=seed * 1_000_003 + index)
        requests.append(BenchRequest(prompt, params))
    return requests


# ShareGPT's mean prompt and output lengths as the vLLM paper reports them (Kwon et al., SOSP 2023:
# 161.31 and 337.99 tokens), and a spread that gives the long right tail such chat logs have.
SHAREGPT_MEAN_INPUT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
SHAREGPT_SIGMA = 1.0  # of the underlying normal; the median is the mean / e^(sigma^2 / 2)


def sharegpt_like_workload(num_requests: int = 256, vocab_size: int = 32000, seed: int = 0,
                           temperature: float = 1.0, max_len: int = 2048) -> list[BenchRequest]:
    """`num_requests` prompts of random token ids whose prompt and output lengths are drawn
    log-normally with ShareGPT's published means (before clipping to [4, max_len] each, as vLLM's
    ShareGPT sampler drops prompts under 4 tokens and over-long pairs); `ignore_eos` with
    min_tokens = max_tokens as in random_workload. Same arguments, same workload."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_len < 4:
        raise ValueError(f"max_len must be >= 4, got {max_len}")
    rng = np.random.default_rng(seed)
    inputs, outputs = (_lognormal_lengths(rng, mean, num_requests, max_len)
                       for mean in (SHAREGPT_MEAN_INPUT_LEN, SHAREGPT_MEAN_OUTPUT_LEN))
    requests = []
    for index, (num_in, num_out) in enumerate(zip(inputs, outputs)):
        prompt = rng.integers(0, vocab_size, int(num_in)).tolist()
        params = SamplingParams(max_tokens=int(num_out), min_tokens=int(num_out), ignore_eos=True,
                                temperature=temperature, seed=seed * 1_000_003 + index)
        requests.append(BenchRequest(prompt, params))
    return requests


def _lognormal_lengths(rng, mean: float, count: int, max_len: int) -> np.ndarray:
    """[count] int lengths, log-normal with the given mean (before clipping to [4, max_len])."""
    mu = np.log(mean) - SHAREGPT_SIGMA ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, SHAREGPT_SIGMA, count)), 4, max_len).astype(np.int64)


def structured_workload(requests: list[BenchRequest], kind: str = "json") -> list[BenchRequest]:
    """The same requests, each constrained by STRUCTURED_KINDS[kind] (ValueError for an unknown kind). A
    grammar that completes ends its request early, so compare output tokens/s, not wall time."""
    if kind not in STRUCTURED_KINDS:
        raise ValueError(f"unknown structured workload {kind!r}; choose from {', '.join(STRUCTURED_KINDS)}")
    spec = STRUCTURED_KINDS[kind]
    return [BenchRequest(r.prompt_token_ids, dataclasses.replace(r.params, structured_outputs=spec))
            for r in requests]


def at_lengths(requests: list[BenchRequest], lengths: list[int]) -> list[BenchRequest]:
    """The same prompts unconstrained, each generating exactly lengths[i] tokens (at least 1): the
    like-for-like plain run of a structured one, whose completed grammars end some requests early."""
    if len(lengths) != len(requests):
        raise ValueError(f"{len(lengths)} lengths for {len(requests)} requests")
    return [BenchRequest(r.prompt_token_ids, dataclasses.replace(
                r.params, max_tokens=max(1, n), min_tokens=max(1, n), ignore_eos=True, structured_outputs=None))
            for r, n in zip(requests, lengths)]


def warm_up_grammars(engine, requests: list[BenchRequest]) -> None:
    """Compile every distinct grammar of the workload before the timing (the compile is cached by spec), then
    run one short constrained request, so that the structured path's first-use work (the mask server's first
    fills, the decode graphs' masked sampling captures, which wait for the device) lands before it too.
    ValueError for a grammar that does not compile, naming its request's file line when it has one."""
    specs = {}  # spec -> its first request
    for r in requests:
        if r.params.structured_outputs is not None:
            specs.setdefault(r.params.structured_outputs, r)
    for spec, request in specs.items():
        try:
            engine.grammar_compiler.compile(spec)
        except ValueError as exc:
            raise ValueError(f"line {request.line}: {exc}" if request.line is not None else str(exc)) from None
    server = engine.grammar_compiler.mask_server if specs else None
    if server is not None:  # its processes build their token tables before the timing, not in it
        server.wait_ready()
    if specs:
        request = next(iter(specs.values()))
        engine.add_request("warmup-grammar", prompt_token_ids=request.prompt_token_ids[:32],
                           params=dataclasses.replace(request.params, max_tokens=4, min_tokens=0))
        while engine.has_unfinished_requests():
            engine.step()


def file_workload(path: str | Path, tokenizer) -> list[BenchRequest]:
    """The requests of a JSONL job (native or OpenAI batch lines), tokenized up front.

    Raises ValueError naming the first line that cannot run (the benchmark runs all or nothing).
    """
    from offline_paged.job.job_input import LineError, parse_line

    requests = []
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            parsed = parse_line(number, text, {})
            if isinstance(parsed, LineError):
                raise ValueError(f"{path}:{number}: {parsed.message}")
            requests.append(BenchRequest(_token_ids(parsed, tokenizer, path), parsed.params, number))
    if not requests:
        raise ValueError(f"{path}: no requests in the file")
    return requests


def _token_ids(parsed, tokenizer, path) -> list[int]:
    try:
        if parsed.prompt_token_ids is not None:
            return list(parsed.prompt_token_ids)
        if parsed.messages is not None:
            return tokenizer.encode(tokenizer.apply_chat_template(parsed.messages))
        return tokenizer.encode(parsed.prompt)
    except ValueError as exc:
        raise ValueError(f"{path}:{parsed.line_number}: {exc}") from None


def max_total_len(requests: Iterable[BenchRequest]) -> int:
    """The longest prompt + max_tokens of a workload (the max_model_len it needs)."""
    return max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)


# --------------------------------------------------------------------------------- ceilings
@dataclass(frozen=True, slots=True)
class Ceilings:
    """Rates measured on the device in this process."""

    bandwidth: float  # bytes/s, device-to-device copy (bytes read + bytes written)
    matmul_flops: float  # FLOP/s, one large square matmul in the model dtype through xp
    how: str


def measure_ceilings(backend) -> Ceilings:
    """Time a large copy and a large matmul with the backend's own array module (median of 5)."""
    xp, dtype = backend.xp, backend.dtype
    cuda = backend.name == "cuda"
    num_bytes = (1 << 30) if cuda else (1 << 26)
    n = 8192 if cuda else 1024
    src = xp.random.default_rng(0).standard_normal(num_bytes // 4, dtype=xp.float32)  # [n] random
    dst = xp.empty_like(src)
    copy_s = _median_time(lambda: xp.copyto(dst, src), cuda, xp)
    a = xp.random.default_rng(1).standard_normal((n, n), dtype=xp.float32).astype(dtype)  # [n, n]
    b = xp.random.default_rng(2).standard_normal((n, n), dtype=xp.float32).astype(dtype)  # [n, n]
    matmul_s = _median_time(lambda: a @ b, cuda, xp)
    how = f"copy of {num_bytes >> 20} MiB, {n}^3 matmul in {np.dtype(dtype).name}, median of 5"
    return Ceilings(2 * num_bytes / copy_s, 2 * n ** 3 / matmul_s, how)


def _median_time(fn, cuda: bool, xp, repeats: int = 5) -> float:
    fn()  # warm-up: handles, kernels, caches
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


# --------------------------------------------------------------------------------- roofline
class RooflineModel:
    """Least bytes moved and FLOPs done by one step of a Llama-layout model (see module doc)."""

    def __init__(self, config, itemsize: int, tensor_parallel_size: int = 1, kv_itemsize: int | None = None,
                 linear_itemsize: int | None = None) -> None:
        """`itemsize`: bytes per element of the model dtype; `kv_itemsize`: per KV-cache element as stored (1
        for the FP8 KV cache); `linear_itemsize`: per layer linear weight (1 with quantization="fp8"; the
        embedding and LM head stay in the model dtype; FP8 linears also read one float32 scale per output
        channel). None: `itemsize`."""
        c = config
        self.itemsize = itemsize
        self.kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
        self.tensor_parallel_size = tensor_parallel_size
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        per_layer = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size \
            + 3 * c.hidden_size * c.intermediate_size
        self.linear_params = c.num_hidden_layers * per_layer  # matmul weights of the layers
        self.head_params = c.vocab_size * c.hidden_size  # the LM head (the embedding when tied)
        self.linear_itemsize = itemsize if linear_itemsize is None else linear_itemsize
        # FP8 linears: their per-output-channel float32 scales (qkv, o_proj, gate_up, down outputs per layer)
        channels = c.num_hidden_layers * (q_dim + 2 * kv_dim + 2 * c.hidden_size + 2 * c.intermediate_size)
        self.linear_scale_bytes = 4 * channels if self.linear_itemsize == 1 else 0
        self.weight_bytes = (self.linear_params * self.linear_itemsize + self.linear_scale_bytes
                             + self.head_params * itemsize)
        self.kv_bytes_per_token = c.num_hidden_layers * 2 * kv_dim * self.kv_itemsize  # as the pool stores it
        self.attention_flops_per_key = c.num_hidden_layers * 4 * q_dim  # QK^T and PV, per (query, key)
        self.hidden_size, self.vocab_size = c.hidden_size, c.vocab_size

    def step_cost(self, scheduled) -> tuple[float, float]:
        """(bytes, FLOPs) of one step given its ScheduledSequences."""
        num_tokens = keys = context = rows = 0
        for item in scheduled:
            q, start = item.num_new_tokens, item.start
            num_tokens += q
            context += start + q
            keys += q * start + q * (q + 1) // 2  # causal: query at position p sees p + 1 keys
            rows += q if item.prompt_logprobs is not None else (1 if item.num_samples else 0)
        bytes_moved = (self.weight_bytes + context * self.kv_bytes_per_token
                       + num_tokens * self.kv_bytes_per_token + rows * self.vocab_size * 4)
        flops = (2 * num_tokens * self.linear_params + 2 * rows * self.head_params
                 + keys * self.attention_flops_per_key)
        n = self.tensor_parallel_size  # per GPU: each holds 1/N of the weights, KV heads and vocabulary
        return float(bytes_moved) / n, float(flops) / n


# --------------------------------------------------------------------------------- one run
@dataclass(slots=True)
class StepRecord:
    end_s: float  # since the run started
    wall_s: float
    schedule_s: float
    execute_s: float
    postprocess_s: float
    forward_s: float | None  # device time of the forward (CUDA events); None on the CPU
    cuda_graph: bool  # the forward replayed CUDA graphs (a decode graph, or a mixed step's pieces)
    num_seqs: int
    num_tokens: int
    blocks_held: int
    blocks_filled: float  # token slots in use / block_size
    floor_s: float | None  # roofline floor of this step
    idle_before_s: float | None = None  # device time from the previous forward's end to this one's start
    token_wait_s: float = 0.0  # of postprocess_s: waiting for the previous step's samples
    mask_dispatch_s: float = 0.0  # of postprocess_s: structured output's feeding and mask-fill start


@dataclass(slots=True)
class BenchResult:
    label: str
    kv_layout: str
    block_size: int
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    wall_s: float
    num_gpu_blocks: int
    max_model_len: int
    num_preemptions: int
    peak_device_memory: int | None  # bytes in use on the device (total - free), peak over steps
    ceilings: Ceilings | None
    steps: list[StepRecord] = field(default_factory=list)
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None  # the engine's, as resolved (EngineConfig.max_num_seqs=None: by device)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype as resolved ("auto" | "fp8_e4m3")
    quantization: str | None = None  # weight quantization (None: the model dtype's weights)
    mask_server: dict | None = None  # structured output: the mask processes' counters over the run
    output_lengths: list[int] = field(default_factory=list)  # tokens of each request's first output, in order
    errors: list[str] = field(default_factory=list)  # requests that ended with an error: "id: message"
    engine_start_s: float | None = None  # the engine's construction (KV sizing, graph captures) and warm-up
    host_load: dict | None = None  # the step loop thread's CPU time and switches, the host's steal (host_load.py)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.wall_s

    @property
    def max_concurrent_seqs(self) -> int:
        return max((s.num_seqs for s in self.steps), default=0)

    @property
    def kv_utilization(self) -> float:
        """Filled slots / slots of held blocks, averaged over steps (internal fragmentation)."""
        held = [s.blocks_filled / s.blocks_held for s in self.steps if s.blocks_held]
        return float(np.mean(held)) if held else 0.0

    @property
    def kv_block_usage(self) -> float:
        """Blocks held / pool, averaged over steps."""
        return float(np.mean([s.blocks_held / self.num_gpu_blocks for s in self.steps])) if self.steps else 0.0

    def step_kinds(self) -> dict[str, dict]:
        """Per kind of step: "decode graph" (one token per sequence, replayed), "prefill graph" (more tokens than
        sequences, replayed piecewise) and "eager": how many, their mean tokens and mean ms of wall, host launch
        (execute) and device forward, and the host-only share of their wall, 1 - forward / wall (forward None on
        the CPU). Kinds without a step are left out."""
        kinds: dict[str, list[StepRecord]] = {}
        for s in self.steps:
            kind = "eager" if not s.cuda_graph else "prefill graph" if s.num_tokens > s.num_seqs else "decode graph"
            kinds.setdefault(kind, []).append(s)
        result = {}
        for kind, steps in kinds.items():
            wall = float(np.mean([s.wall_s for s in steps]))
            forward = None if steps[0].forward_s is None else float(np.mean([s.forward_s for s in steps]))
            result[kind] = {"num_steps": len(steps), "tokens": float(np.mean([s.num_tokens for s in steps])),
                            "wall_ms": 1e3 * wall, "execute_ms": 1e3 * float(np.mean([s.execute_s for s in steps])),
                            "forward_device_ms": None if forward is None else 1e3 * forward,
                            "host_only_share": None if forward is None or wall <= 0 else 1 - forward / wall}
        return result

    def time_split(self) -> dict[str, float | None]:
        """Mean milliseconds per step: wall, schedule, execute, device forward, and the rest."""
        n = max(len(self.steps), 1)
        total = {k: sum(getattr(s, k) for s in self.steps)
                 for k in ("wall_s", "schedule_s", "execute_s", "postprocess_s", "token_wait_s", "mask_dispatch_s")}
        forward = None if not self.steps or self.steps[0].forward_s is None else \
            sum(s.forward_s for s in self.steps)
        return {
            "num_steps": len(self.steps),
            "step_ms": 1e3 * total["wall_s"] / n,
            "schedule_ms": 1e3 * total["schedule_s"] / n,
            "execute_ms": 1e3 * total["execute_s"] / n,
            "postprocess_ms": 1e3 * total["postprocess_s"] / n,
            "token_wait_ms": 1e3 * total["token_wait_s"] / n,  # (parts of postprocess_ms)
            "mask_dispatch_ms": 1e3 * total["mask_dispatch_s"] / n,
            "num_cuda_graph_steps": sum(s.cuda_graph for s in self.steps),
            # graph steps with more tokens than sequences: some sequence prefilled (mixed_graphs.py)
            "num_prefill_graph_steps": sum(s.cuda_graph and s.num_tokens > s.num_seqs for s in self.steps),
            "forward_device_ms": None if forward is None else 1e3 * forward / n,
            "host_ms": 1e3 * (total["wall_s"] - (forward if forward is not None else total["execute_s"])) / n,
            "device_idle_ms": None if forward is None else
            1e3 * sum(s.idle_before_s or 0.0 for s in self.steps) / n,
        }

    def roofline(self) -> dict[str, float] | None:
        if self.ceilings is None or not self.steps or self.steps[0].floor_s is None:
            return None
        floor = sum(s.floor_s for s in self.steps)
        return {"floor_s": floor, "output_tokens_per_s_at_floor": self.num_output_tokens / floor,
                "fraction_of_floor": floor / self.wall_s,
                "bandwidth_gb_s": self.ceilings.bandwidth / 1e9,
                "matmul_tflop_s": self.ceilings.matmul_flops / 1e12, "ceilings": self.ceilings.how}

    def summary(self) -> dict[str, Any]:
        """Everything but the per-step series, as plain JSON-able values."""
        return {
            "label": self.label, "kv_layout": self.kv_layout, "block_size": self.block_size,
            "tensor_parallel_size": self.tensor_parallel_size, "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.quantization, "max_num_seqs": self.max_num_seqs,
            "kv_capacity_tokens": self.num_gpu_blocks * self.block_size,
            "num_requests": self.num_requests, "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens, "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s,
            "peak_device_memory_bytes": self.peak_device_memory, "num_gpu_blocks": self.num_gpu_blocks,
            "max_model_len": self.max_model_len, "kv_utilization": self.kv_utilization,
            "kv_block_usage": self.kv_block_usage, "max_concurrent_seqs": self.max_concurrent_seqs,
            "num_preemptions": self.num_preemptions, "time_split": self.time_split(), "step_kinds": self.step_kinds(),
            "roofline": self.roofline(), "mask_server": self.mask_server, "num_errors": len(self.errors),
            "errors": self.errors[:10], "engine_start_s": self.engine_start_s, "host_load": self.host_load,
        }

    def to_json(self, with_steps: bool = False) -> str:
        data = self.summary()
        if with_steps:
            data["steps"] = [asdict(s) for s in self.steps]
        return json.dumps(data)


def warm_up(engine, vocab_size: int, num_requests: int = 4) -> None:
    """A few short requests so kernel compilation and handle creation stay out of the timing. The second
    half arrives while the first decodes, so a step prefills beside decodes too: that path's first call
    compiles kernels and imports modules (cupyx, 0.1-0.45 s on the H200's host), which a timed run's first
    mixed step would otherwise pay."""
    rng = random.Random(12345)
    for index in range(num_requests):
        if index == num_requests // 2:
            engine.step()  # the first half prefills; the second is admitted beside its decodes
        length = max(1, min(48 + 16 * index, engine.max_model_len - 4))
        prompt = [rng.randrange(vocab_size) for _ in range(length)]
        engine.add_request(f"warmup-{index}", prompt_token_ids=prompt,
                           params=SamplingParams(max_tokens=min(4, engine.max_model_len - length),
                                                 ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


FREEZE_EVERY = 32  # steps between gc.freeze() calls in run_bench
# Each run's record carries `host_load` (host_load.py): the step loop thread's CPU time and switches, the host's
# steal. Two /proc reads a run; False leaves the record's `host_load` null.
RECORD_HOST_LOAD = True


def run_bench(engine, requests: list[BenchRequest], *, label: str = "", kv_layout: str = "paged",
              ceilings: Ceilings | None = None) -> BenchResult:
    """Add every request, step until done, record each step. The engine should be warm."""
    manager = engine.block_manager
    tensor_parallel_size = engine.config.tensor_parallel_size
    # KV bytes as the pool stores them (1 an element for FP8); weights in the model dtype
    # quantization="fp8", or a pre-quantized FP8 checkpoint (its config's quantization_config)
    quantization = engine.config.quantization or (
        "fp8" if getattr(engine.model_config, "quantization", None) is not None else None)
    roofline = RooflineModel(engine.model_config, np.dtype(engine.backend.dtype).itemsize, tensor_parallel_size,
                             kv_itemsize=engine.runner.kv_cache.dtype.itemsize,
                             linear_itemsize=1 if quantization == "fp8" else None)
    preemptions_before = engine.stats.num_preemptions
    server = getattr(engine, "mask_server", None)
    server_before = None if server is None else server.stats()
    for index, request in enumerate(requests):
        engine.add_request(f"bench-{index}", prompt_token_ids=request.prompt_token_ids,
                           params=request.params)
    output_lengths = [0] * len(requests)
    errors = []
    memory = _DeviceMemory(engine.backend)
    num_prompt = num_output = 0
    steps: list[StepRecord] = []
    # Read after the run: a timer's reading waits for its step, which would stop the overlap, and the
    # per-sequence sums (tokens, roofline) are host work the timed loop should not carry.
    timers, schedules = [], []
    # Those records grow to about 260k objects (a 1B run), which CPython's full collections then walk:
    # three of them cost about 100 ms of a 3.4 s run on the H200's host, while a `generate` job keeps no
    # such records. Freezing moves everything alive into a generation the collector never scans (the
    # engine's own objects too, which a `generate` job's collections still walk, at gc_pacing's pace).
    load_before = LoadSnapshot.take() if RECORD_HOST_LOAD else None
    start = time.perf_counter()
    try:
        with gc_pacing.paced():  # what a `generate` job runs with
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                finished, report = engine.step_with_report()
                t1 = time.perf_counter()
                for output in finished:
                    if isinstance(output, RequestError):  # (a grammar that refused a token mid-generation)
                        errors.append(f"{output.request_id}: {output.message}")
                        continue
                    num_prompt += len(output.prompt_token_ids)
                    num_output += sum(len(c.token_ids) for c in output.outputs)
                    output_lengths[int(output.request_id.removeprefix("bench-"))] = len(output.outputs[0].token_ids)
                steps.append(_record(t1 - start, t1 - t0, report, engine, manager))
                timers.append(report.forward_timer)
                schedules.append(report.scheduled)  # ScheduledSequences are read-only once built: safe to read later
                if len(steps) % 16 == 0:
                    memory.sample()
                if len(steps) % FREEZE_EVERY == 0:
                    gc.freeze()
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - start
    host_load = None if load_before is None else over_run(load_before, LoadSnapshot.take(), len(steps))
    memory.sample()
    no_forward = 0.0 if engine.backend.name == "cuda" else None  # a GPU step without a forward took 0 s
    previous = None
    for step, timer, scheduled in zip(steps, timers, schedules):
        step.forward_s = no_forward if timer is None else timer.elapsed_s()
        step.idle_before_s = None if timer is None or previous is None else timer.idle_since_s(previous)
        previous = timer or previous
        step.num_tokens = sum(s.num_new_tokens for s in scheduled)
        if ceilings is not None:
            bytes_moved, flops = roofline.step_cost(scheduled)
            step.floor_s = (max(bytes_moved / ceilings.bandwidth, flops / ceilings.matmul_flops)
                            if scheduled else 0.0)
    return BenchResult(
        label=label or kv_layout, kv_layout=kv_layout, block_size=manager.block_size,
        num_requests=len(requests), num_prompt_tokens=num_prompt, num_output_tokens=num_output,
        wall_s=wall, num_gpu_blocks=manager.num_gpu_blocks, max_model_len=engine.max_model_len,
        num_preemptions=engine.stats.num_preemptions - preemptions_before,
        peak_device_memory=memory.peak, ceilings=ceilings, steps=steps,
        tensor_parallel_size=tensor_parallel_size, max_num_seqs=engine.config.max_num_seqs,
        kv_cache_dtype=engine.kv_cache_dtype, quantization=quantization,
        mask_server=None if server is None else _counters_over_run(server_before, server.stats()),
        output_lengths=output_lengths, errors=errors, host_load=host_load)


def _counters_over_run(before: dict, after: dict) -> dict:
    """A MaskServer's counters over one run, its waits in mean ms per fill."""
    fills = max(after["num_fills"] - before["num_fills"], 1)
    delta = {key: after[key] - before[key] for key in ("num_fills", "num_outcomes", "num_resent")}
    return delta | {"num_workers": after["num_workers"],
                    "outcome_wait_ms": 1e3 * (after["outcome_wait_s"] - before["outcome_wait_s"]) / fills,
                    "mask_wait_ms": 1e3 * (after["mask_wait_s"] - before["mask_wait_s"]) / fills}


def _record(end_s, wall_s, report, engine, manager) -> StepRecord:
    """One step's record from the engine's own StepReport (no wrapping of engine methods). The forward's
    device time, the token count and the roofline floor are filled in after the run."""
    stats = engine.stats  # KV occupancy as the step's forward saw it
    held = round(stats.kv_block_usage_current * manager.num_gpu_blocks)
    return StepRecord(end_s, wall_s, report.schedule_s, report.execute_s, report.postprocess_s,
                      None, report.used_cuda_graph, len(report.scheduled), 0, held,
                      stats.kv_utilization_current * held, None,
                      token_wait_s=report.token_wait_s, mask_dispatch_s=report.mask_dispatch_s)


class _DeviceMemory:
    """Peak of device memory in use (total - free, all of this process's allocations) on CUDA."""

    def __init__(self, backend) -> None:
        self._runtime = backend.xp.cuda.runtime if backend.name == "cuda" else None
        self.peak: int | None = None
        self.sample()

    def sample(self) -> None:
        if self._runtime is None:
            return
        free, total = self._runtime.memGetInfo()
        self.peak = max(self.peak or 0, int(total - free))


def release_device_memory(backend) -> None:
    """Return freed pool memory to the device between runs (CUDA; a no-op on the CPU)."""
    if backend.name == "cuda":
        backend.xp.get_default_memory_pool().free_all_blocks()


def kv_bytes_per_token(model_config, itemsize: int) -> int:
    c = model_config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * itemsize

