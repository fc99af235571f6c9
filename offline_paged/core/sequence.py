"""Sequence (one token stream with its KV-cache bookkeeping) and SequenceGroup (one request: its prompt,
params and the n sequences sampled from it). Pure Python: the scheduler and Hypothesis drive these.

A sequence's known tokens are `token_ids` = prompt + generated; `num_pending_tokens` more will be
sampled by steps already scheduled (their ids reach the host later: async scheduling), and
`num_tokens` counts both. `num_computed_tokens` have K/V in the cache or are computed by a step already
scheduled (the scheduler advances it when it schedules a chunk); `num_slots` have a KV slot reserved
by the block manager. Invariant while running:
    num_computed_tokens <= num_slots <= num_tokens,
and a sequence is ready to sample when num_computed_tokens == num_tokens.
A request with n > 1 starts with one sequence; when its prompt is computed, the sampled row is drawn
n times and the sequence is forked (blocks shared copy-on-write) into n sequences.
A beam-search request (`group.beam` is a beam_search.BeamState) also starts with one sequence; its
`seqs` are the live beams, replaced by forked children at every beam step (see beam_search.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued for (re)admission; holds no KV blocks
    RUNNING = "running"  # holds device KV blocks
    SWAPPED = "swapped"  # its KV blocks live in the CPU pool
    FINISHED = "finished"  # done; blocks released
    PARKED = "parked"  # a beam whose next-token result is known, waiting for its sibling beams;
    #                    preempted while idle: it holds no blocks and sits in no queue


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class TokenSample:
    """One sampled token as the runner hands it up (the sampler's SampleResult has these fields)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class SequenceResult:
    """What the runner produced for one scheduled sequence in one step. Read-only once built (not frozen:
    one is built per scheduled sequence per step, and a frozen __init__ costs about 4x a plain one).

    samples: empty while a prefill is unfinished; one per sequence otherwise; num_samples of the
    request when the prompt row is drawn for a fork. prompt_logprobs: entries for the prompt
    positions this chunk predicted (start + 1 ... start + num_new_tokens, clipped to the prompt).
    """

    samples: list[Any]
    prompt_logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream. Identity (not value) equality: two sequences are never interchangeable."""

    seq_id: int
    group: SequenceGroup
    sample_index: int
    sampling_seed: int
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_slots: int = 0
    num_skip_write: int = 0  # leading positions whose cached K/V must not be rewritten
    # Tokens a scheduled step will sample but the host does not know yet (see num_tokens). 0 between
    # steps of the synchronous loop; with async scheduling at most 2 (the step on the device and the
    # one being scheduled after it).
    num_pending_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    finished_by_eos: bool = False
    text: str | None = None  # final text when a stop string cut it (the stop string excluded)
    detokenizer: Any = None  # incremental detokenizer, created by the stop checker when needed
    # Structured output: the grammar state after the known output tokens (a StructuredMatcher, fed by the
    # stop checker; forks copy it), and the message of a matcher error that ended the sequence.
    matcher: Any = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending ones: the length the scheduler plans with."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def priority(self) -> tuple[int, int]:
        """Smaller = older = scheduled first and preempted last (FCFS by request arrival)."""
        return (self.group.arrival_index, self.sample_index)

    def append_token(self, sample: Any) -> None:
        """Append a sampled token; it resolves the oldest pending token if there is one."""
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1
        self.token_ids.append(int(sample.token_id))
        self.cumulative_logprob += float(sample.logprob)
        if self.logprobs is not None:
            entry = dict(sample.top_logprobs or {})
            entry[int(sample.token_id)] = float(sample.logprob)
            self.logprobs.append(entry)

    def fork(self, seq_id: int, sample_index: int, sampling_seed: int) -> Sequence:
        """A copy sharing nothing mutable: same known tokens and cache bookkeeping, its own stream,
        no pending tokens (its first token is appended by whoever forks it)."""
        return Sequence(
            seq_id=seq_id, group=self.group, sample_index=sample_index, sampling_seed=sampling_seed,
            token_ids=list(self.token_ids), num_prompt_tokens=self.num_prompt_tokens,
            status=self.status, num_computed_tokens=self.num_computed_tokens,
            num_slots=self.num_slots, num_skip_write=self.num_skip_write,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=self.cumulative_logprob,
            matcher=None if self.matcher is None else self.matcher.fork(),
        )

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def forget_cache(self) -> None:
        """Recompute preemption: the KV is gone; prompt and generated tokens will be re-prefilled."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_slots = 0
        self.num_skip_write = 0


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: prompt, sampling params and its sequences (1, or num_samples after the fork).

    `sample_seeds[i]` is the random-stream seed of sample i (decided by the engine at admission).
    """

    request_id: str
    arrival_index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    sample_seeds: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prefix-cache hit on first admission
    forked: bool = False
    beam: Any = None  # beam_search.BeamState of a beam-search request, else None
    scoring_only: bool = False  # max_tokens=0: it runs one greedy token for its prompt logprobs, returned as none

    @property
    def num_logprobs(self) -> int | None:
        """Top-k logprobs to report per generated token (None: not asked). Beam search asks the
        runner for more than the user did, so its params.logprobs is not the user's."""
        return self.beam.num_logprobs if self.beam is not None else self.params.logprobs

    @property
    def num_samples(self) -> int:
        return len(self.sample_seeds)

    @property
    def needs_fork(self) -> bool:
        return not self.forked and self.num_samples > 1 and self.beam is None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True until every prompt position has its logprob entry."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return not self.needs_fork and all(s.is_finished for s in self.seqs)

    @property
    def num_pending_seqs(self) -> int:
        """Sequences this request will occupy once forked (what admission must make room for)."""
        return self.num_samples if self.needs_fork else 1
