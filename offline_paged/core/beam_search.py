"""Beam search: which beams a request keeps after each step, and when it is done. Pure Python.

A beam-search request keeps up to `beam_width` live beams (Sequences). The runner computes each
beam's next-token row and returns its raw top-k log-probabilities (the engine asks for
k = 2·beam_width, plus the number of tokens banned before min_tokens, so the candidates below are
exact). Results arrive beam by beam (beams may be scheduled in different steps, or preempted);
BeamState parks them in `pending` and the scheduler calls `step()` once every live beam has one.

One beam step (the rule of vLLM's original beam search, with HF's `early_stopping="never"` test):
1. Candidates: every (beam, token) among the beams' top-k rows, scored
   `beam.cumulative_logprob + logprob(token)`; before min_tokens, EOS (unless ignore_eos) and the
   stop token ids are not candidates. Ties go to the earlier beam, then the lower token id.
2. The best 2·beam_width candidates are checked with the stop checker: finished ones (EOS, stop
   token or string, max_tokens, max_model_len) become hypotheses; the best `beam_width` live ones
   become the next beams, each a fork of its parent (so beams share prefix blocks copy-on-write).
3. Hypotheses are ranked by the length-penalised score `cumulative_logprob / length**1.0`
   (vLLM's default length_penalty=1.0; length counts prompt and output tokens, not a final EOS);
   only the best `beam_width` are kept.
4. The request is done when no live beam is left, or when `beam_width` hypotheses exist and no
   live beam can ever beat the worst of them. Log-probabilities are <= 0, so a beam's future score
   is at most `cumulative_logprob / max_len` (max_len = min(prompt + max_tokens, max_model_len)):
   stopping on that bound never changes the result (unlike vLLM's `early_stopping=False`
   heuristic, which uses the current length and can stop too soon).
The request returns its best n hypotheses, best first.

Structured output: each beam carries its own grammar matcher (Sequence.matcher). The runner takes a
grammar beam's top-k among the tokens its mask allows (EOS only where the grammar accepts), so the
candidates above stay exact. A candidate's child is a fork of its parent, matcher included, and the stop
checker advances the child's own copy by the candidate token: siblings never share a matcher, and a
completed grammar finishes the hypothesis (STOP). A beam left without a candidate (its grammar allows
nothing, or only tokens banned before min_tokens) and a child its matcher refuses are dropped; only when
no live beam and no hypothesis is left does the request fail, with `BeamState.error` saying why.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offline_paged.core.sequence import Sequence, TokenSample

LENGTH_PENALTY = 1.0

# Called on a sequence after a token is appended: (reason, stop_reason) when it must stop.
StopChecker = Callable[[Sequence], Any]


def beam_score(seq: Sequence, length_penalty: float = LENGTH_PENALTY) -> float:
    """Length-penalised score of a hypothesis (vLLM's: a final EOS does not count as length)."""
    length = seq.num_tokens - (1 if seq.finished_by_eos else 0)
    return seq.cumulative_logprob / length ** length_penalty


def runner_top_k(beam_width: int, num_banned: int, user_logprobs: int | None) -> int:
    """Top log-probabilities the runner must return per beam row for exact candidates."""
    return max(2 * beam_width + num_banned, user_logprobs or 0)


@dataclass(frozen=True, slots=True)
class _Candidate:
    score: float  # parent's cumulative logprob + logprob
    beam_order: int  # parent's position among the live beams (tie-break)
    token_id: int
    logprob: float
    parent: Sequence
    top_logprobs: dict[int, float]  # the parent's row, best first


@dataclass(frozen=True, slots=True)
class BeamStep:
    """The outcome of one beam step: (child, parent) pairs, best first; none when `done`."""

    children: list[tuple[Sequence, Sequence]]
    done: bool


@dataclass(slots=True, eq=False)
class BeamState:
    """Per-request beam-search state.

    pending: seq_id -> the runner's result (a SampleResult) for each live beam that has one.
    hypotheses: finished sequences, best score first, at most beam_width.
    Invariant: pending only holds live beams of the current step; it is emptied by step().
    """

    beam_width: int
    max_len: int  # longest the request can grow: min(prompt + max_tokens, max_model_len)
    banned_before_min_tokens: frozenset[int] = frozenset()
    num_logprobs: int | None = None  # what the user asked for (the runner is asked for more)
    pending: dict[int, Any] = field(default_factory=dict)
    hypotheses: list[Sequence] = field(default_factory=list)
    num_beams_created: int = 1  # the prompt sequence is beam 0; children get the next indices
    error: str | None = None  # set when the request ends with no beam and no hypothesis (grammar dead ends)

    def add_result(self, seq: Sequence, sample: Any) -> None:
        if seq.seq_id in self.pending:
            raise RuntimeError(f"beam {seq.seq_id} got a second result in one beam step")
        self.pending[seq.seq_id] = sample

    def is_idle(self, seq: Sequence) -> bool:
        """True when the beam's result is in and it only waits for its siblings."""
        return seq.seq_id in self.pending

    def is_ready(self, live: list[Sequence]) -> bool:
        return bool(live) and all(s.seq_id in self.pending for s in live)

    def best(self, n: int) -> list[Sequence]:
        return self.hypotheses[:n]

    def step(self, live: list[Sequence], stop_checker: StopChecker,
             new_seq_id: Callable[[], int]) -> BeamStep:
        """Rank the candidates of all live beams; returns the next beams (see the module docstring).
        Raises RuntimeError if a live beam has no result yet."""
        if not self.is_ready(live):
            raise RuntimeError("beam step before every live beam has its result")
        children: list[tuple[Sequence, Sequence]] = []
        refused = None
        for candidate in self._candidates(live)[:2 * self.beam_width]:
            child = self._extend(candidate, new_seq_id())
            stop = stop_checker(child)
            if child.error is not None:  # its grammar matcher refused the token: the child is dropped
                refused = child.error
            elif stop is not None:
                child.finish(*stop)
                self._add_hypothesis(child)
            elif len(children) < self.beam_width:
                children.append((child, candidate.parent))
        self.pending.clear()
        done = not children or self._cannot_improve(children[0][0])
        if done and not self.hypotheses:
            self.error = refused or self._dead_end_message(live)
        return BeamStep([] if done else children, done)

    @staticmethod
    def _dead_end_message(live: list[Sequence]) -> str:
        params = live[0].group.params
        why = f" (EOS and stop_token_ids are banned before min_tokens={params.min_tokens})" if params.min_tokens else ""
        return f"no beam is left: the grammar allowed no candidate token on any beam{why}"

    def _candidates(self, live: list[Sequence]) -> list[_Candidate]:
        candidates = []
        for order, beam in enumerate(live):
            row = self.pending[beam.seq_id].top_logprobs
            if not row and beam.matcher is None:
                raise RuntimeError(f"beam {beam.seq_id}: the runner returned no top logprobs")
            # (an empty row of a grammar beam: its grammar allows no token, and the beam is dropped)
            early = beam.num_output_tokens < beam.group.params.min_tokens
            banned = self.banned_before_min_tokens if early else frozenset()
            candidates += [_Candidate(beam.cumulative_logprob + logprob, order, token, logprob, beam, row)
                           for token, logprob in row.items() if token not in banned]
        candidates.sort(key=lambda c: (-c.score, c.beam_order, c.token_id))
        return candidates

    def _extend(self, candidate: _Candidate, seq_id: int) -> Sequence:
        parent = candidate.parent
        child = parent.fork(seq_id, self.num_beams_created, parent.sampling_seed)
        self.num_beams_created += 1
        shown = None
        if child.logprobs is not None:  # the user's top-k: the row is sorted best first
            shown = dict(list(candidate.top_logprobs.items())[:self.num_logprobs])
        child.append_token(TokenSample(candidate.token_id, candidate.logprob, shown))
        return child

    def _add_hypothesis(self, seq: Sequence) -> None:
        self.hypotheses.append(seq)
        self.hypotheses.sort(key=beam_score, reverse=True)
        del self.hypotheses[self.beam_width:]

    def _cannot_improve(self, best_live: Sequence) -> bool:
        """True when even the best live beam can never score above the worst kept hypothesis."""
        if len(self.hypotheses) < self.beam_width:
            return False
        bound = best_live.cumulative_logprob / self.max_len ** LENGTH_PENALTY
        return bound <= beam_score(self.hypotheses[-1])
