"""Sampler: one token per row of logits, with vLLM's order of operations.

structured-output mask (a packed int32 bitmask per row, from the request's grammar) -> token constraints
(allowed_token_ids, bad_words, logit_bias) -> penalties (repetition on
prompt+output tokens, presence/frequency on output tokens) -> min_tokens
ban on EOS/stop ids -> temperature -> top-k -> top-p -> min-p -> choose. Greedy rows
(temperature 0) take the argmax of the penalised logits. Random rows take the argmax over allowed
tokens of p_i / (-log u_i) with u_i = random_stream.uniform(seed, position, i): an exponential race,
which draws exactly from p and depends only on (seed, position), never on the batch.

Log-probabilities reported (`SampleResult.logprob`, `top_logprobs`) are always those of the raw
model distribution, log_softmax(logits), before penalties, temperature and filters (vLLM v1's
default). Ties at a top-k or top-p boundary are kept (every token with the boundary value stays).
A beam-search row under a grammar (`ranks_allowed_tokens`) reports its top-k among the tokens its mask
allows only, with those same raw values: beam candidates come from that top-k, so every one is allowed.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.worker.random_stream import uniform

_ROWS_PER_CHUNK = 32  # bounds the [rows, vocab] uint64 temporaries of the race


@dataclass(slots=True, frozen=True)
class SamplingRequest:
    """What the sampler needs to know about one row of logits.

    seed: the row's stream seed (random_stream.stream_seed of the request seed and sample index).
    position: the output position being sampled (0 for the first generated token).
    token_bitmask: [ceil(V / 32)] int32, bit t of word t // 32 set where token t is allowed (structured
    output); None: every token.
    """

    params: SamplingParams
    seed: int
    position: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    token_bitmask: np.ndarray | None = None


@dataclass(slots=True)
class SampleResult:
    """The chosen token, its raw log-probability, and the raw top-k (None unless asked). Read-only once built
    (not frozen: one is built per sampled row per step, and a frozen __init__ costs about 4x a plain one)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64: [S, V] -> [S, V] (also works on one [V] row)."""
    shifted = np.array(logits, dtype=np.float64)  # a fresh copy, shifted in place
    shifted -= np.max(shifted, axis=-1, keepdims=True)
    shifted -= _log_sum_exp_shifted(shifted)
    return shifted


def _log_sum_exp_shifted(shifted: np.ndarray) -> np.ndarray:
    """log(sum(exp(shifted))) over the last axis, keepdims (shifted: max already subtracted)."""
    return np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def raw_logprobs_of(logits: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """log_softmax(logits)[row, token_ids[row]] for each row, without materialising the [S, V] result
    (the same float64 operations, so the same bits). logits [S, V], token_ids [S] -> [S] float64."""
    maxima = np.max(logits, axis=-1, keepdims=True).astype(np.float64)  # [S, 1]
    shifted = np.asarray(logits, dtype=np.float64) - maxima  # [S, V]
    rows = np.arange(len(token_ids))
    return shifted[rows, token_ids] - _log_sum_exp_shifted(shifted)[:, 0]


def top_logprobs(row_logprobs: np.ndarray, k: int, chosen: int | None = None) -> dict[int, float]:
    """The k highest entries of one [V] log-probability row, best first, plus `chosen` if absent."""
    k = min(k, row_logprobs.shape[0])
    top = np.argpartition(-row_logprobs, k - 1)[:k] if k > 0 else np.empty(0, np.int64)
    top = top[np.argsort(-row_logprobs[top], kind="stable")]
    result = {int(i): float(row_logprobs[i]) for i in top}
    if chosen is not None and chosen not in result:
        result[int(chosen)] = float(row_logprobs[chosen])
    return result


def ranks_allowed_tokens(request: SamplingRequest) -> bool:
    """Whether the row's top log-probabilities are taken among the tokens its grammar allows: a beam row
    with a structured-output mask (its beam candidates are that top-k, so each must be allowed)."""
    return request.token_bitmask is not None and request.params.use_beam_search


def allowed_top_logprobs(row_logprobs: np.ndarray, token_bitmask: np.ndarray, k: int) -> dict[int, float]:
    """The k highest entries of one [V] log-probability row among the tokens `token_bitmask` ([W] int32)
    allows, best first: fewer when fewer are allowed, none when none is. No chosen token is added."""
    allowed = unpack_bitmask(token_bitmask[None], row_logprobs.shape[0])[0]  # [V]
    top = top_logprobs(np.where(allowed, row_logprobs, -np.inf), k)
    return {token: value for token, value in top.items() if value != -np.inf}


def _reported_top(row_logprobs: np.ndarray, request: SamplingRequest, chosen: int) -> dict[int, float]:
    if ranks_allowed_tokens(request):
        return allowed_top_logprobs(row_logprobs, request.token_bitmask, request.params.logprobs)
    return top_logprobs(row_logprobs, request.params.logprobs, chosen)


class Sampler:
    """Stateless sampler; `eos_token_ids` are banned (with stop_token_ids) before min_tokens."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def sample(self, logits: np.ndarray, requests: Sequence[SamplingRequest]) -> list[SampleResult]:
        """logits [S, V] (one row per request) -> one SampleResult per row, in order."""
        if logits.ndim != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [num_requests={len(requests)}, vocab], got {logits.shape}"
            )
        adjusted = np.array(logits, dtype=np.float64)  # [S, V], penalised in place
        apply_token_bitmasks(adjusted, requests)
        for row, request in enumerate(requests):
            apply_token_constraints(adjusted[row], request)
            apply_penalties(adjusted[row], request)
            self._ban_before_min_tokens(adjusted[row], request)
        token_ids = self._choose(adjusted, requests)
        chosen_logprobs = raw_logprobs_of(logits, token_ids)  # [S]; the full rows only where asked
        asking = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        raw = dict(zip(asking, log_softmax(logits[asking]))) if asking else {}
        return [SampleResult(int(t), float(lp), None if row not in raw else _reported_top(raw[row], r, int(t)))
                for row, (t, lp, r) in enumerate(zip(token_ids, chosen_logprobs, requests))]

    def _ban_before_min_tokens(self, row: np.ndarray, request: SamplingRequest) -> None:
        params = request.params
        if request.position >= params.min_tokens:  # position = tokens generated before this one
            return
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += self.eos_token_ids
        if banned:
            row[banned] = -np.inf

    def _choose(self, adjusted: np.ndarray, requests: Sequence[SamplingRequest]) -> np.ndarray:
        token_ids = np.empty(len(requests), dtype=np.int64)  # [S]
        greedy = np.array([r.params.temperature == 0.0 for r in requests], dtype=bool)
        if greedy.any():
            token_ids[greedy] = np.argmax(adjusted[greedy], axis=1)
        random_rows = np.flatnonzero(~greedy)
        for start in range(0, len(random_rows), _ROWS_PER_CHUNK):
            rows = random_rows[start:start + _ROWS_PER_CHUNK]
            token_ids[rows] = _race(adjusted[rows], [requests[i] for i in rows])
        return token_ids


def apply_token_bitmasks(adjusted: np.ndarray, requests: Sequence[SamplingRequest]) -> None:
    """adjusted [S, V] in place: -inf wherever a row's token_bitmask has the token's bit clear."""
    masked = [row for row, r in enumerate(requests) if r.token_bitmask is not None]
    if not masked:
        return
    masks = np.stack([requests[row].token_bitmask for row in masked])  # [Sm, W] int32
    allowed = unpack_bitmask(masks, adjusted.shape[1])  # [Sm, V]
    rows = adjusted[masked]  # [Sm, V] (a copy: fancy indexing)
    rows[~allowed] = -np.inf
    adjusted[masked] = rows


def unpack_bitmask(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R, W] int32 packed (bit t of word w is token 32 w + t) -> [R, vocab_size] bool; tokens past
    32 W are not allowed."""
    words = np.ascontiguousarray(masks, dtype=np.int32).astype("<i4", copy=False)  # little-endian bytes
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # [R, 32 W]
    allowed = np.zeros((masks.shape[0], vocab_size), dtype=bool)  # [R, V]
    width = min(vocab_size, bits.shape[1])
    allowed[:, :width] = bits[:, :width].astype(bool)
    return allowed


def apply_token_constraints(row: np.ndarray, request: SamplingRequest) -> None:
    """vLLM v1's order on one [V] logit row, in place: only allowed_token_ids survive, then the last
    token of every bad word whose other tokens end the output is banned, then logit_bias is added."""
    params = request.params
    if params.allowed_token_ids is not None:
        keep = np.zeros(row.shape[0], dtype=bool)  # [V]
        keep[list(params.allowed_token_ids)] = True
        row[~keep] = -np.inf
    banned = bad_word_bans(params._bad_words_token_ids, request.output_token_ids)
    if banned:
        row[banned] = -np.inf
    if params.logit_bias:
        row[list(params.logit_bias)] += np.fromiter(params.logit_bias.values(), np.float64)


def bad_word_bans(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """Token ids that would complete a bad word: its last token, where its other tokens end the output."""
    banned = []
    num_output = len(output_token_ids)
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or list(output_token_ids[num_output - prefix_len:]) == list(word[:prefix_len]):
            banned.append(word[-1])
    return banned


def apply_penalties(row: np.ndarray, request: SamplingRequest) -> None:
    """vLLM's penalties on one [V] logit row, in place.

    repetition (tokens seen in prompt or output): x > 0 -> x / r, else x * r;
    then frequency and presence (output tokens only): x -= f * count + p * (count > 0).
    """
    params = request.params
    vocab_size = row.shape[0]
    if params.repetition_penalty != 1.0:
        seen = _token_array(list(request.prompt_token_ids) + list(request.output_token_ids),
                            vocab_size)
        seen = np.unique(seen)
        values = row[seen]
        row[seen] = np.where(values > 0, values / params.repetition_penalty,
                             values * params.repetition_penalty)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        counts = np.bincount(_token_array(request.output_token_ids, vocab_size),
                             minlength=vocab_size)  # [V]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def filter_logits(scaled: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Apply top-k, then top-p, then min-p to temperature-scaled logits [R, V] (-inf = excluded)."""
    x = scaled.copy()  # [R, V]
    for row, p in enumerate(params):
        if p.top_k > 0:
            _top_k(x[row], p.top_k)
        if p.top_p < 1.0:
            _top_p(x[row], p.top_p)
        if p.min_p > 0.0:
            _min_p(x[row], p.min_p)
    return x


def _race(adjusted: np.ndarray, requests: Sequence[SamplingRequest]) -> np.ndarray:
    """Exponential race on random rows: argmax_i p_i / (-log u_i). adjusted [R, V] -> [R]."""
    temperatures = np.array([r.params.temperature for r in requests])[:, None]  # [R, 1]
    scaled = adjusted / temperatures  # [R, V]
    params = [r.params for r in requests]
    filtered = filter_logits(scaled, params) if any(map(_filters, params)) else scaled  # [R, V]
    probs = log_softmax(filtered)  # [R, V]
    np.exp(probs, out=probs)  # excluded tokens are exactly 0
    seeds = np.array([r.seed & (2**64 - 1) for r in requests], dtype=np.uint64)
    positions = np.array([r.position for r in requests], dtype=np.uint64)
    kept = probs > 0.0  # [R, V]
    if np.count_nonzero(kept) > kept.size // 4:  # dense: every token draws
        u = uniform(seeds[:, None], positions[:, None], np.arange(probs.shape[1], dtype=np.uint64)[None, :])
        np.log(u, out=u)
        np.subtract(0.0, u, out=u)  # arrival [R, V]; 0.0 - x, not -x: u == 1.0 must give +0.0, never -0.0
        with np.errstate(divide="ignore", invalid="ignore"):  # u == 1.0: arrival 0, p / 0 = inf wins
            np.divide(probs, u, out=probs)
        probs[~kept] = -1.0
        return np.argmax(probs, axis=1)
    rows, cols = np.nonzero(kept)  # [n] each: the race runs over the survivors alone
    u = uniform(seeds[rows], positions[rows], cols.astype(np.uint64))  # [n]
    arrival = 0.0 - np.log(u)  # [n]
    scores = np.full(probs.shape, -1.0)  # [R, V]
    with np.errstate(divide="ignore"):
        scores[rows, cols] = probs[rows, cols] / arrival
    return np.argmax(scores, axis=1)


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _top_k(row: np.ndarray, k: int) -> None:
    if k >= row.shape[0]:
        return
    kth_largest = np.partition(row, row.shape[0] - k)[row.shape[0] - k]
    row[row < kth_largest] = -np.inf


def _top_p(row: np.ndarray, top_p: float) -> None:
    """Keep the smallest most-probable set whose mass reaches top_p (at least one token)."""
    probs = np.exp(log_softmax(row))  # [V]
    descending = np.sort(probs)[::-1]  # [V]
    mass_before = np.cumsum(descending) - descending  # [V]
    num_kept = int(np.count_nonzero(mass_before < top_p))
    smallest_kept = descending[max(num_kept, 1) - 1]
    row[probs < smallest_kept] = -np.inf


def _min_p(row: np.ndarray, min_p: float) -> None:
    probs = np.exp(log_softmax(row))  # [V]
    row[probs < min_p * probs.max()] = -np.inf


def _token_array(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)  # [N]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids
