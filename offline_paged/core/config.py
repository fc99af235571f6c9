"""EngineConfig: every knob of one engine instance, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

GiB = 1 << 30


class PreemptionMode(Enum):
    """What happens to a sequence's KV cache when it is preempted."""

    RECOMPUTE = "recompute"  # drop the blocks; re-prefill prompt + generated tokens on readmission
    SWAP = "swap"  # copy the blocks to the CPU pool; copy them back on readmission


DEVICES = ("auto", "cpu", "cuda")
KV_LAYOUTS = ("paged", "contiguous")
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings; callers map them before EngineConfig
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" is e4m3 as in vLLM
QUANTIZATIONS = ("fp8",)  # weight quantizations besides None (ops/fp8_linear.py has the same tuple)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Configuration of one LLMEngine. Names follow vLLM where the concept is the same.

    KV pool size: `num_kv_blocks` wins when given; otherwise `kv_cache_memory` bytes (CPU default
    1 GiB, capped at what max_num_seqs sequences of max_model_len tokens could ever use); on CUDA
    without either, free device memory after the weights x `gpu_memory_utilization`.
    CPU swap pool: `num_cpu_blocks` wins when given; otherwise `swap_space` bytes.
    `max_model_len=None` means the model's own context length (capped by the KV pool).
    `kv_layout="contiguous"` is the baseline paging is measured against: every sequence reserves
    blocks for max_model_len tokens when it is admitted (same pool, same kernels).
    `cuda_graphs`: steps where every sequence computes one token replay a captured forward per batch
    bucket (offline_paged/worker/cuda_graph_runner.py); ignored on the CPU (CUDA runs float16 or bfloat16).
    `dtype`: "auto" (the default; None means the same) is float32 on the CPU and the checkpoint's
    torch_dtype on CUDA (bfloat16 / float16; a float32 checkpoint runs in float16, as in vLLM); see
    offline_paged/worker/backend.py. float32 and float64 are CPU-only.
    `async_scheduling`: overlap the host's scheduling and output processing with the device's step
    (outputs are identical to the synchronous loop; see LLMEngine.step_with_report).
    `kv_cache_dtype`: "auto" stores K/V in the model dtype; "fp8" / "fp8_e4m3" in float8_e4m3fn (1 byte an
    element: the same memory holds 2x the blocks of a 16-bit pool, 4x of a float32 one) with per-layer K and
    V scales, 1.0 unless `calculate_kv_scales` takes them from the first prefill (offline_paged/ops/kv_scales.py).
    Both backends run it (CUDA: uint8 pools and the _fp8 kernels); not with tensor_parallel_size > 1 yet.
    `quantization`: None, or "fp8" (vLLM's name): the layers' linear weights quantized to e4m3 at load with
    one scale per output channel, activations per token at each product (offline_paged/ops/fp8_linear.py).
    Both backends (CUDA: cuBLASLt's FP8 GEMM, ops/cuda_fp8_linear.py; models/llama.py's FP8_WEIGHTS_ON_CUDA switches
    it off there); not with tensor_parallel_size > 1. A pre-quantized
    FP8 checkpoint (an FP8 `quantization_config` in its config.json) needs no flag: models/quant_config.py.
    """

    model: str | None = None  # HF dir / GGUF path / name; None = the default model
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str | None = "auto"  # "auto"/None: float32 on CPU, the checkpoint's torch_dtype on CUDA
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the device KV pool
    num_kv_blocks: int | None = None
    swap_space: int = 1 * GiB  # bytes for the CPU swap pool (used by preemption_mode="swap")
    num_cpu_blocks: int | None = None
    # None = auto (auto_max_num_seqs): 1024 on a CUDA device of at least 70 GiB, else 256; the engine fits 1024
    # to its sized KV pool (fit_max_num_seqs: 512 where the pool holds fewer than 512 tokens a sequence).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # None = auto (auto_max_num_batched_tokens): 8192 on CUDA, else 2048
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    gpu_memory_utilization: float = 0.9
    watermark: float = 0.01  # fraction of blocks kept free when admitting new prompts
    kv_layout: str = "paged"  # "paged" | "contiguous" (reserve max_model_len at admission)
    cuda_graphs: bool = True  # replay decode-only steps from CUDA graphs (CUDA only)
    # With cuda_graphs: steps that prefill, of up to this many tokens (and max_num_batched_tokens), replay
    # piecewise graphs with attention run between the pieces (offline_paged/worker/mixed_graphs.py); 0 = off.
    # Larger steps are bound by the device, so launching them eagerly costs nothing.
    mixed_graph_tokens: int = 2048
    # Schedule and launch step N+1 while step N runs on the device; N's sampled ids reach N+1's inputs
    # on the device and its outputs are processed one step late. None = on for CUDA, off on the CPU.
    async_scheduling: bool | None = None
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    # Shard the model over N processes (one GPU each on CUDA, NCCL; pipes on the CPU); rank 0 runs the
    # scheduler. N must divide the heads, KV heads and intermediate size (models/tp_shard.py).
    tensor_parallel_size: int = 1
    # While every running sequence decodes, admit waiting ones only once this many fit (core/scheduler.py):
    # fewer steps that prefill beside the decodes. None = auto: max_num_seqs // 8 on CUDA, 1 on the CPU.
    admission_batch: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8" | "fp8_e4m3" (FP8 KV cache)
    calculate_kv_scales: bool = False  # FP8 KV: per-layer scales from the first prefill instead of 1.0
    quantization: str | None = None  # None | "fp8": linear weights in e4m3 (models/llama.py)
    # Structured output: processes that fill the overlapped steps' grammar masks (core/mask_server.py).
    # None = auto: min(8, cores // 2) on CUDA (auto_grammar_mask_processes; cores: HostCpus.usable_cores), else 0.
    # Only with async scheduling (the sync loop fills masks when it needs them: nothing to overlap).
    grammar_mask_processes: int | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} or None, got {self.dtype!r}")
        require_positive("block_size", self.block_size)
        if self.max_num_seqs is not None:
            require_positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None:
                require_positive(name, value)
        if self.max_model_len == 1:  # the engine needs room for a prompt token and one more
            raise ValueError("max_model_len must be at least 2 (a prompt token and one more), got 1")
        if not isinstance(self.mixed_graph_tokens, int) or self.mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be a non-negative integer (0: off), got "
                             f"{self.mixed_graph_tokens!r}")
        for name in ("swap_space", "num_cpu_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        modes = [m.value for m in PreemptionMode]
        if self.preemption_mode not in modes:
            raise ValueError(f"preemption_mode must be one of {modes}, got {self.preemption_mode!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        require_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.admission_batch is not None:
            require_positive("admission_batch", self.admission_batch)
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.grammar_mask_processes is not None:
            require_non_negative("grammar_mask_processes", self.grammar_mask_processes)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be True or False, got {self.calculate_kv_scales!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported: use None or one of {QUANTIZATIONS}")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization={self.quantization!r} is not supported with tensor_parallel_size > 1 "
                             "yet; leave quantization unset")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with tensor_parallel_size > 1 "
                             "yet; use kv_cache_dtype='auto'")

    @property
    def preemption(self) -> PreemptionMode:
        return PreemptionMode(self.preemption_mode)

    def resolved_kv_cache_dtype(self, backend_name: str) -> str:
        """"auto" or "fp8_e4m3" ("fp8" is e4m3), on every backend (`backend_name` is kept for the callers:
        the CPU stores float8_e4m3fn, CUDA its bits as uint8)."""
        return "auto" if self.kv_cache_dtype == "auto" else "fp8_e4m3"

    def with_device_defaults(self, backend_name: str, device_memory_bytes: int | None) -> EngineConfig:
        """This config with the fields left to the device (None) filled: max_num_seqs (auto_max_num_seqs) and
        max_num_batched_tokens (auto_max_num_batched_tokens). The engine runs on the result."""
        return replace(self, max_num_seqs=self.max_num_seqs or auto_max_num_seqs(backend_name, device_memory_bytes),
                       max_num_batched_tokens=self.max_num_batched_tokens or auto_max_num_batched_tokens(backend_name))

    def resolved_admission_batch(self, backend_name: str) -> int:
        """admission_batch, or its default on this backend: batches of max_num_seqs // 8 on CUDA, where a
        step that prefills runs eagerly beside the decode graphs (measured at N = 1024 in
        benchmarks/RESULTS.md); 1 on the CPU, where a mixed step costs about its tokens."""
        if self.admission_batch is not None:
            return self.admission_batch
        return max(1, self.max_num_seqs // 8) if backend_name == "cuda" else 1

    def resolved_grammar_mask_processes(self, backend_name: str, async_scheduling: bool, num_cores: int) -> int:
        """grammar_mask_processes, or its default, auto_grammar_mask_processes. Always 0 without async
        scheduling, whose masks are filled when they are needed."""
        if not async_scheduling:
            return 0
        if self.grammar_mask_processes is not None:
            return self.grammar_mask_processes
        return auto_grammar_mask_processes(backend_name, num_cores)


LARGE_DEVICE_MEMORY = 70 * GiB  # an H100 / H200 (80 / 141 GB): room for four times the sequences of a smaller GPU


def auto_max_num_seqs(backend_name: str, device_memory_bytes: int | None) -> int:
    """1024 on a CUDA device of at least 70 GiB (vLLM's LLM class takes the same), else 256. With decode
    graphs up to 1,024 sequences, a 1,024-request job ran 1.06-1.07x faster at 1,024 than at 512 on the 1B
    shape (H100 and H200) and 1.04x on the 8B on an H200, but 0.97x on the 8B on an H100, whose KV pool
    holds ~330 tokens a sequence at 1,024 (79 preemptions; benchmarks/RESULTS.md, session 46). The CPU's
    step costs about its sequences, and a smaller device holds fewer sequences' KV, so both stay at 256."""
    if backend_name == "cuda" and device_memory_bytes is not None and device_memory_bytes >= LARGE_DEVICE_MEMORY:
        return 1024
    return 256


MIN_KV_TOKENS_PER_SEQ = 512  # 1,024 sequences only where the KV pool holds this many tokens for each


def fit_max_num_seqs(max_num_seqs: int, kv_capacity_tokens: int, max_model_len: int) -> int:
    """A device's max_num_seqs (auto_max_num_seqs) fitted to its KV pool: 1,024 falls back to 512 where the
    pool holds fewer than MIN_KV_TOKENS_PER_SEQ tokens (or max_model_len, if shorter) for each sequence.
    Measured at N = 1,024 (nano-vllm lengths): the 8B shape on an H100 (331 tokens a sequence at 1,024) ran
    79 recompute preemptions and 0.97x of 512, on an H200 (~870) none and 1.04x; the 1B holds 2,000 on
    both (benchmarks/RESULTS.md, session 46). vLLM keeps 1,024 and preempts."""
    if max_num_seqs > 512 and kv_capacity_tokens < max_num_seqs * min(MIN_KV_TOKENS_PER_SEQ, max_model_len):
        return 512
    return max_num_seqs


def auto_max_num_batched_tokens(backend_name: str) -> int:
    """8192 on CUDA, 2048 on the CPU. On CUDA, `generate` then runs the budget `bench` measures; on an H100 at 512
    sequences it ran within noise of 2048 (1,024 requests: medians 47.1k against 45.9k out tok/s; sharegpt-like
    4,096: 55.8k against 54.0k; benchmarks/RESULTS.md). On the CPU a step costs about its tokens, so smaller
    steps keep the decodes flowing."""
    return 8192 if backend_name == "cuda" else 2048


def auto_grammar_mask_processes(backend_name: str, num_cores: int) -> int:
    """min(8, cores // 2) on CUDA where that is at least 2, else 0. A 1B decode step is shorter than one
    process's fill of 256 masks over a 128k vocabulary, so processes share the fill; but each one more is
    another process to wake and another reply to read every step. On four H100 hosts 4 ran the JSON bench
    as fast as 8 on one (like for like 0.936 against 0.940), faster on two (medians 0.858 against 0.808;
    0.946 against 0.828) and slower on one (medians 0.851 against 0.897): benchmarks/RESULTS.md, sessions
    39, 44, 50 and 51. Neither wins across hosts, so 8 stays, the count the H200 has run. num_cores:
    physical cores (`HostCpus.usable_cores`), as an SMT sibling of the step loop's core slows the loop itself."""
    processes = min(8, num_cores // 2)
    return processes if backend_name == "cuda" and processes >= 2 else 0


def require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
