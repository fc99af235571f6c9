"""RequestProcessor: a request as the user gave it -> the SequenceGroup the scheduler runs.

Everything about a request that is settled once, at admission, lives here and nowhere else: checking its
parameters against this engine (vocabulary, max_logprobs, max_num_seqs), tokenising and checking the
prompt (truncation, vocabulary, max_model_len), tokenising bad words, scoring-only requests, beam search's
state and runner parameters, and each sample's random-stream seed. The facts derived from a request are
computed once and read where they are needed: `SamplingParams.has_penalties` / `needs_token_history`
(the engine's async check, the decode graph's sampler, the GPU sampler) and `SequenceGroup.scoring_only`
(the engine's output).
"""
from __future__ import annotations

import dataclasses
import itertools

from offline_paged.core.beam_search import BeamState, runner_top_k
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.sequence import SequenceGroup
from offline_paged.worker.random_stream import stream_seed, unseeded_request_seed


def ids_in_range(token_ids: list, vocab_size: float) -> bool:
    """Whether every id is an int (not a bool) in [0, vocab_size). A tokenizer's ids take the fast path
    (one C-level pass each for the types, the min and the max: about half the time of a per-token test on a
    1,000-token prompt); anything else gets the per-token test, so int subclasses pass as before."""
    if set(map(type, token_ids)) == {int}:
        return 0 <= min(token_ids) and max(token_ids) < vocab_size
    return all(not isinstance(t, bool) and isinstance(t, int) and 0 <= t < vocab_size for t in token_ids)


class RequestProcessor:
    """Validates and tokenises requests for one engine. Arrival indices (which seed unseeded requests)
    count only the requests that were accepted."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._arrivals = itertools.count()

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's params (None: the defaults), checked against what a SamplingParams alone cannot
        know: this engine's vocabulary and caps. Checked before anything is sized by the request (n seeds)
        or reaches a step (an id past the vocabulary)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab_size = self.vocab_size
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < the vocabulary size ({vocab_size}), "
                             f"got {max(params.stop_token_ids)}")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name}={value} is more than max_logprobs "
                                 f"({self.config.max_logprobs}), the engine's cap")
        if params.num_samples > self.config.max_num_seqs:
            raise ValueError(f"the request needs {params.num_samples} parallel samples (n / best_of) "
                             f"but max_num_seqs is {self.config.max_num_seqs}")
        return params

    def process(self, request_id: str, prompt: str | None, prompt_token_ids, params: SamplingParams) -> SequenceGroup:
        """The request's SequenceGroup (params from `check_params`). ValueError for a bad prompt (see
        `prompt_token_ids`) or beam search with penalties."""
        token_ids = self.prompt_token_ids(prompt, prompt_token_ids, params.truncate_prompt_tokens,
                                          generates=params.max_tokens > 0)
        scoring_only = params.max_tokens == 0
        params = self._runner_params(params)
        beam = self._beam_state(params, len(token_ids)) if params.use_beam_search else None
        arrival = next(self._arrivals)
        return SequenceGroup(
            request_id=request_id, arrival_index=arrival, prompt=prompt, prompt_token_ids=token_ids,
            params=params if beam is None else self._beam_runner_params(params, beam),
            sample_seeds=self._sample_seeds(params, arrival),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None, beam=beam,
            scoring_only=scoring_only,
        )

    def prompt_token_ids(self, prompt: str | None, prompt_token_ids, truncate: int | None = None,
                         generates: bool = True) -> list[int]:
        """The prompt's ids (`prompt` text is tokenised when no ids are given); one that only scores
        (generates=False) may fill max_model_len. ValueError for an empty prompt, ids outside the
        vocabulary, or one that leaves no room to generate."""
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if prompt_token_ids is not None:
            token_ids = list(prompt_token_ids)
        elif prompt is not None:
            token_ids = self.tokenizer.encode(prompt)
        else:
            raise ValueError("give a prompt (text) or prompt_token_ids")
        if truncate is not None:  # keep the last tokens, as vLLM (-1: as many as max_model_len allows)
            token_ids = token_ids[-(self.max_model_len - 1 if truncate == -1 else truncate):]
        vocab_size = self.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty (it must have at least one token)")
        if not ids_in_range(token_ids, vocab_size):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size})")
        if len(token_ids) > self.max_model_len - generates:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, which leaves no room to generate")
        return token_ids

    def _runner_params(self, params: SamplingParams) -> SamplingParams:
        """Tokenize bad_words (vLLM's way: with and without a leading space), and turn max_tokens=0
        into one discarded greedy token (the group is scoring_only: the engine drops it)."""
        if params.bad_words:
            params = dataclasses.replace(params, _bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        if params.max_tokens == 0:
            return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=params.prompt_logprobs,
                                  prompt_logprobs_start=params.prompt_logprobs_start, detokenize=False)
        return params

    def _bad_words_token_ids(self, bad_words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        words: list[tuple[int, ...]] = []
        for word in bad_words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            words.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):  # a distinct word-start form
                words.append(spaced)
        return tuple(words)

    def _beam_state(self, params: SamplingParams, num_prompt_tokens: int) -> BeamState:
        for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0)):
            if getattr(params, name) != neutral:
                raise ValueError(f"{name} must be left at {neutral} when use_beam_search is true "
                                 "(beams are ranked by raw log-probabilities)")
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return BeamState(
            beam_width=params.beam_width,
            max_len=min(num_prompt_tokens + params.max_tokens, self.max_model_len),
            banned_before_min_tokens=frozenset(banned) if params.min_tokens else frozenset(),
            num_logprobs=params.logprobs,
        )

    @staticmethod
    def _beam_runner_params(params: SamplingParams, beam: BeamState) -> SamplingParams:
        """The user's params, asking the runner for enough top logprobs to rank the candidates."""
        top_k = runner_top_k(beam.beam_width, len(beam.banned_before_min_tokens), params.logprobs)
        return dataclasses.replace(params, logprobs=top_k)

    def _sample_seeds(self, params: SamplingParams, arrival: int) -> list[int]:
        """Seed of each sample's random stream: the request's seed, or one derived from the engine
        seed and the request's arrival index; sample i > 0 gets stream_seed(seed, i)."""
        if params.seed is not None:
            base = params.seed
        else:
            base = unseeded_request_seed(self.config.seed, arrival)
        return [stream_seed(base, i) for i in range(params.num_samples)]
