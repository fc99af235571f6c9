"""What the engine hands back: RequestOutput (one per request) holding CompletionOutputs, and EngineStats.

Shapes follow vLLM's so its users feel at home:
- `logprobs`: one dict per generated token, {token_id: logprob} with the top-k tokens plus the
  sampled one (None when the request did not ask for logprobs).
- `prompt_logprobs`: one entry per prompt token; the first is None (nothing predicts it), the
  others are {token_id: logprob} with the actual prompt token plus the top-k (positions before
  `prompt_logprobs_start` are None too).
The engine's values are plain floats (the JSONL job writes those); `LLM` hands out vLLM's
`Logprob(logprob, rank, decoded_token)` objects instead (see `to_logprob_dicts`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's per-token log-probability record. `rank` is 1 for the most likely token; None when the
    engine did not rank the token (a sampled or prompt token outside the requested top-k).
    `decoded_token` is None when the request set detokenize=False."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def to_logprob_dicts(entries, num_top: int, decode: Callable[[int], str] | None):
    """The engine's [{token_id: float} | None] -> [{token_id: Logprob} | None]. An engine entry lists
    its top `num_top` tokens best first, then the chosen token if it is not among them."""
    if entries is None:
        return None
    result = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        result.append({token_id: Logprob(value, rank + 1 if rank < num_top else None,
                                         None if decode is None else decode(token_id))
                       for rank, (token_id, value) in enumerate(entry.items())})
    return result


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
class BeamSearchSequence:
    """One hypothesis of `LLM.beam_search` (vLLM's shape): `tokens` are prompt + output ids, `text` the
    output text (a final EOS left out), `logprobs` one {token_id: Logprob} per output token."""

    tokens: list[int]
    logprobs: list[dict]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """The hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


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
    or it was on workers that died). `step()` returns it in place of a RequestOutput, once.
    `unfinished`: not the request's fault (its workers died); a job writes nothing for it, so a
    rerun runs it again."""

    request_id: str
    message: str
    unfinished: bool = False
