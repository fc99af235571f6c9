"""What the engine hands back: RequestOutput (one per request) holding CompletionOutputs, and EngineStats.

Shapes follow vLLM's so its users feel at home:
- `logprobs`: one dict per generated token, {token_id: logprob} with the top-k tokens plus the
  sampled one (None when the request did not ask for logprobs).
- `prompt_logprobs`: one entry per prompt token; the first is None (nothing predicts it), the
  others are {token_id: logprob} with the actual prompt token plus the top-k.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence of a request (n > 1 gives several, ordered by `index`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (None if not tracked)
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort"; None while unfinished
    stop_reason: int | str | None = None  # stop string or stop token id that ended it (EOS id too)
    finished_by_eos: bool = False  # True when the model's EOS token ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The result of one request, handed out once when all its sequences have finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of one engine's life so far (a snapshot; the engine builds a fresh one on demand).

    `kv_utilization_*` is the fraction of the slots in allocated KV blocks that hold a token
    (1.0 = no internal fragmentation); `kv_block_usage_*` is the fraction of the pool's blocks
    in use. Averages are over engine steps.
    """

    num_requests_finished: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_prompt_tokens: int  # prompt tokens served by the prefix cache
    prefix_cache_hit_rate: float  # num_cached_prompt_tokens / prompt tokens looked up
    num_preemptions_recompute: int
    num_preemptions_swap: int
    kv_utilization_current: float
    kv_utilization_average: float
    kv_block_usage_current: float
    kv_block_usage_average: float
    kv_block_usage_peak: float
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    num_steps: int

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    def to_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request that an engine handed back without running it (a data-parallel worker refused it,
    or it was on workers that died). `step()` returns it in place of a RequestOutput, once."""

    request_id: str
    message: str
