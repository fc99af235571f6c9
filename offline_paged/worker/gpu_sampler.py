"""GpuSampler: the NumPy Sampler's semantics on device logits, so only the sampled ids (and the requested
log-probabilities) cross to the host: one upload of the step's per-row parameters, one download.

Same order of operations as offline_paged/worker/sampler.py, in float64 on the GPU (cuda/sampling.cu):
structured-output bitmask -> token constraints -> penalties -> EOS/stop ban before min_tokens -> temperature -> top-k -> top-p -> min-p -> greedy argmax or
the exponential race with random_stream's uniforms. Rows with top-k or top-p find their threshold
without a sort (sampling.cu's top_cut, a bitwise descent), so the decode graph's sampler
(cuda_graph_runner.py) runs the very same kernels on the same packed rows (sampling_rows.pack_params) and
draws the same tokens. Tokens match the NumPy sampler except where two candidates' keys agree to the last
bits (CUDA's exp/log vs NumPy's, summation order). A beam row under a grammar (sampler.ranks_allowed_tokens)
takes its top log-probabilities among its allowed tokens, as the NumPy sampler does.

Legend: R sampled rows, K logits rows, V vocab, Rp penalty rows, Ra top-logprob rows.
"""
from __future__ import annotations

from collections.abc import Sequence

import cupy
import numpy as np

from offline_paged.ops import sampling_launcher as kernels
from offline_paged.ops.pinned import PinnedDownload, PinnedUpload
from offline_paged.worker.sampler import SampleResult, SamplingRequest, bad_word_bans, ranks_allowed_tokens
from offline_paged.worker.sampling_rows import pack_params, pack_seeds


class GpuSampler:
    """Stateless like Sampler; `eos_token_ids` are banned (with stop_token_ids) before min_tokens."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._upload = PinnedUpload()  # the per-row inputs cross without waiting for the device
        self._mask_upload = PinnedUpload()  # structured-output masks: their own slots, as many steps in flight
        self._top_mask_upload = PinnedUpload()  # the masks of beam rows' top-k (two uploads a step, as above)

    def sample(self, logits, rows: Sequence[int], requests: Sequence[SamplingRequest]) -> list[SampleResult]:
        """logits [K, V] float32 (device); request i samples logits row rows[i]. One result per request."""
        return self.sample_async(logits, rows, requests).results()

    def sample_async(self, logits, rows: Sequence[int], requests: Sequence[SamplingRequest]) -> PendingSamples:
        """`sample` with the kernels queued and nothing copied back yet: the sampled ids stay on the
        device (`token_ids`) until `results()` downloads them."""
        if len(rows) != len(requests):
            raise ValueError(f"{len(rows)} logits rows for {len(requests)} requests")
        if not requests:
            return PendingSamples(None, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, [])
        logits = cupy.ascontiguousarray(logits, dtype=cupy.float32)  # [K, V]
        num_rows, vocab = len(requests), logits.shape[1]
        step = _upload(requests, rows, vocab, self.eos_token_ids, self._upload)
        adjusted = cupy.empty((num_rows, vocab), dtype=cupy.float64)  # [R, V]
        raw_stats = cupy.empty((num_rows, 2), dtype=cupy.float64)  # [R, 2] (max, logsumexp - max)
        kernels.prepare_rows(logits, step["rows"], adjusted, raw_stats)
        self._apply_token_bitmasks(adjusted, requests)
        _apply_token_constraints(adjusted, requests)
        if step["penalty_rows"].size:
            seen = cupy.zeros((step["penalty_rows"].size, vocab), dtype=cupy.int32)  # [Rp, V]
            counts = cupy.zeros_like(seen)  # [Rp, V]
            kernels.count_tokens(step["penalty_tokens"], seen, counts)
            kernels.apply_penalties(adjusted, step["penalty_rows"], step["penalties"], seen, counts)
        kernels.ban_tokens(adjusted, step["banned"])
        cut = cupy.empty(num_rows, dtype=cupy.float64)  # [R]
        kernels.top_cut(adjusted, step["params"], cut)  # the decode graph's sampler runs the same kernel
        top_ks = _top_ks(requests, vocab)
        asking = np.flatnonzero(top_ks)  # rows that want a top-k of logprobs
        k_max = int(top_ks.max())
        out = cupy.empty(2 * num_rows + 2 * asking.size * k_max, dtype=cupy.float64)  # packed results
        chosen = out[:2 * num_rows].reshape(num_rows, 2)  # [R, 2] (token id, raw logprob)
        kernels.race(adjusted, cut, logits, step["rows"], step["params"], step["seeds"],
                     step["positions"], chosen)
        allowed_only = [ranks_allowed_tokens(r) for r in requests]
        if asking.size:
            _top_logprobs(logits, step["rows"], raw_stats, asking, k_max, out[2 * num_rows:],
                          self._top_masks(requests, asking, allowed_only))
        wants = [r.params.logprobs is not None for r in requests]
        return PendingSamples(out, num_rows, top_ks, asking, k_max, wants, allowed_only=allowed_only)

    def _top_masks(self, requests: Sequence[SamplingRequest], asking: np.ndarray, allowed_only: list[bool]):
        """(slots [Rb] int32 into `asking`, masks [Rb, W] int32) of the rows whose top-k is taken among their
        allowed tokens (beam rows under a grammar), uploaded; None when there are none."""
        slots = [j for j, r in enumerate(asking.tolist()) if allowed_only[r]]
        if not slots:
            return None
        masks = np.stack([requests[asking[j]].token_bitmask for j in slots]).astype(np.int32, copy=False)  # [Rb, W]
        return self._top_mask_upload(np.asarray(slots, dtype=np.int32)), self._top_mask_upload(masks)


    def _apply_token_bitmasks(self, adjusted, requests: Sequence[SamplingRequest]) -> None:
        """The structured-output masks of the rows that carry one (packed int32, one upload for the step)."""
        masked = [r for r, request in enumerate(requests) if request.token_bitmask is not None]
        if not masked:
            return
        masks = np.stack([requests[r].token_bitmask for r in masked]).astype(np.int32, copy=False)  # [Rm, W]
        kernels.apply_token_bitmask(adjusted, self._mask_upload(np.asarray(masked, dtype=np.int32)),
                                    self._mask_upload(masks))


class PendingSamples:
    """A sampling launch: the packed device results `out` (see GpuSampler.sample), already being copied
    to pinned host memory, until `results()` waits for that copy."""

    __slots__ = ("_out", "_download", "_num_rows", "_top_ks", "_asking", "_k_max", "_wants", "_token_ids",
                 "_allowed_only")

    def __init__(self, out, num_rows: int, top_ks, asking, k_max: int, wants: list[bool],
                 token_ids=None, allowed_only: list[bool] | None = None) -> None:
        self._out, self._num_rows = out, num_rows
        self._download = PinnedDownload(out) if num_rows else None  # queued right behind the kernels
        self._top_ks, self._asking, self._k_max, self._wants = top_ks, asking, k_max, wants
        self._token_ids = token_ids
        self._allowed_only = allowed_only or [False] * num_rows

    @classmethod
    def of_graph(cls, out, token_ids) -> PendingSamples:
        """The decode graph's samples: out [S, 2] float64 (token id, raw logprob) and token_ids [S] int32,
        views of the bucket's static buffers. Its download is queued now, before the bucket's next replay."""
        num_rows = out.shape[0]
        return cls(out.reshape(-1), num_rows, np.zeros(num_rows, np.int64), np.zeros(0, np.int64), 0,
                   [False] * num_rows, token_ids)

    @property
    def token_ids(self):
        """[R] int32 (device): the sampled ids, for the next step's inputs."""
        if self._token_ids is None:
            self._token_ids = self._out[:2 * self._num_rows:2].astype(cupy.int32)
        return self._token_ids

    def results(self) -> list[SampleResult]:
        if not self._num_rows:
            return []
        host = self._download.wait()  # the one device->host copy
        return _results(host, self._top_ks, self._asking, self._k_max, self._wants, self._allowed_only)


def _apply_token_constraints(adjusted, requests: Sequence[SamplingRequest]) -> None:
    """allowed_token_ids, bad words and logit_bias on the device rows [R, V], before the penalties
    (sampler.apply_token_constraints' order). Rows without constraints cost one Python check."""
    for r, request in enumerate(requests):
        p = request.params
        if p.allowed_token_ids is not None:
            keep = cupy.zeros(adjusted.shape[1], dtype=cupy.bool_)  # [V]
            keep[cupy.asarray(p.allowed_token_ids, dtype=cupy.int64)] = True
            adjusted[r] = cupy.where(keep, adjusted[r], -cupy.inf)
        banned = bad_word_bans(p._bad_words_token_ids, request.output_token_ids)
        if banned:
            adjusted[r, cupy.asarray(banned, dtype=cupy.int64)] = -cupy.inf
        if p.logit_bias:
            ids = cupy.asarray(list(p.logit_bias), dtype=cupy.int64)  # [b]
            adjusted[r, ids] += cupy.asarray(list(p.logit_bias.values()), dtype=cupy.float64)


def _top_ks(requests: Sequence[SamplingRequest], vocab: int) -> np.ndarray:
    return np.array([min(r.params.logprobs or 0, vocab) for r in requests], dtype=np.int64)  # [R]


def _upload(requests: Sequence[SamplingRequest], rows: Sequence[int], vocab: int,
            eos_token_ids: tuple[int, ...], to_device=cupy.asarray) -> dict:
    """Pack the step's per-row inputs into one uint64 and one int32 host array, upload each once, and
    return named device views."""
    num_rows = len(requests)
    fields = np.array([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty, r.position < p.min_tokens)
                       for r in requests for p in (r.params,)], dtype=np.float64).reshape(num_rows, 4)  # [R, 4]
    params = pack_params([r.params for r in requests])  # [R, 8], as the decode graph's rows
    penalized = np.fromiter((r.params.has_penalties for r in requests), bool, num_rows)  # [R]
    penalty_rows = np.flatnonzero(penalized)
    penalties = fields[penalty_rows, 0:3]  # [Rp, 3]
    penalty_tokens = [_penalty_tokens(requests[r], slot, vocab) for slot, r in enumerate(penalty_rows)]
    banned = []
    for r in np.flatnonzero(fields[:, 3]).tolist():  # rows still under min_tokens
        p = requests[r].params
        ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        banned += [(r, t) for t in ids if 0 <= t < vocab]
    seeds = pack_seeds([r.seed for r in requests])  # [R]
    positions = np.array([r.position for r in requests], dtype=np.uint64)  # [R]
    wide = [params.ravel().view(np.uint64), seeds, positions,
            np.asarray(penalties, dtype=np.float64).reshape(-1).view(np.uint64)]
    tokens = np.concatenate(penalty_tokens) if penalty_tokens else np.zeros((0, 3), np.int32)  # [P, 3]
    narrow = [np.asarray(rows, dtype=np.int32), np.asarray(penalty_rows, dtype=np.int32), tokens.ravel(),
              np.asarray(banned, dtype=np.int32).reshape(-1)]
    w = _views(to_device(np.concatenate(wide)), [a.size for a in wide])
    n = _views(to_device(np.concatenate(narrow).astype(np.int32)), [a.size for a in narrow])
    return {"params": w[0].view(cupy.float64).reshape(num_rows, kernels.PARAMS_WIDTH), "seeds": w[1],
            "positions": w[2], "penalties": w[3].view(cupy.float64).reshape(-1, 3),
            "rows": n[0], "penalty_rows": n[1], "penalty_tokens": n[2].reshape(-1, 3),
            "banned": n[3].reshape(-1, 2)}


def _views(packed, sizes: list[int]) -> list:
    views, at = [], 0
    for size in sizes:
        views.append(packed[at:at + size])
        at += size
    return views


def _penalty_tokens(request: SamplingRequest, slot: int, vocab: int) -> np.ndarray:
    """(slot, token, is_output) rows [P, 3]: prompt tokens only matter to the repetition penalty."""
    prompt = request.prompt_token_ids if request.params.repetition_penalty != 1.0 else ()
    ids = np.concatenate([np.asarray(prompt, np.int64), np.asarray(request.output_token_ids, np.int64)])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
    tokens = np.empty((ids.size, 3), dtype=np.int32)  # [P, 3]
    tokens[:, 0] = slot
    tokens[:, 1] = ids
    tokens[:, 2] = np.arange(ids.size) >= len(prompt)
    return tokens


def _top_logprobs(logits, rows, raw_stats, asking: np.ndarray, k_max: int, out, top_masks=None) -> None:
    """out[:Ra*k] = ids, out[Ra*k:] = raw logprobs of each asking row's k_max best tokens, best first.
    top_masks: (slots into asking, masks) of rows ranked among their allowed tokens only (the others -inf)."""
    picked = cupy.asarray(asking)  # [Ra]
    raw = logits[rows[picked]]  # [Ra, V] float32
    if top_masks is not None:
        raw = raw.astype(cupy.float64)  # exact: the same order and values; the mask kernel takes float64 rows
        kernels.apply_token_bitmask(raw, *top_masks)
    ids = cupy.argsort(-raw, axis=1)[:, :k_max]  # [Ra, k] (fp32 order == raw logprob order)
    values = cupy.take_along_axis(raw, ids, axis=1).astype(cupy.float64)  # [Ra, k]
    stats = raw_stats[picked]  # [Ra, 2]
    size = asking.size * k_max
    out[:size] = ids.ravel()
    out[size:] = ((values - stats[:, :1]) - stats[:, 1:]).ravel()


def _results(host: np.ndarray, top_ks: np.ndarray, asking: np.ndarray, k_max: int,
             wants: list[bool], allowed_only: list[bool]) -> list[SampleResult]:
    num_rows = top_ks.size
    chosen = host[:2 * num_rows].reshape(num_rows, 2)  # [R, 2]
    size = asking.size * k_max
    top_ids = host[2 * num_rows:2 * num_rows + size].reshape(asking.size, k_max).astype(np.int64)  # [Ra, k]
    top_values = host[2 * num_rows + size:].reshape(asking.size, k_max)  # [Ra, k]
    tokens, logprobs = chosen[:, 0].astype(np.int64).tolist(), chosen[:, 1].tolist()
    if not any(wants):
        return [SampleResult(t, lp, None) for t, lp in zip(tokens, logprobs)]
    slot_of = {int(r): j for j, r in enumerate(asking)}
    results = []
    for r in range(num_rows):
        token, logprob = tokens[r], logprobs[r]
        top = None
        if wants[r]:  # the top k best first, then the chosen token if it is not among them (as sampler.py)
            j, k = slot_of.get(r, 0), int(top_ks[r])
            top = {int(i): float(v) for i, v in zip(top_ids[j, :k], top_values[j, :k])} if k else {}
            if allowed_only[r]:  # as sampler.allowed_top_logprobs: masked tokens dropped, no chosen token added
                top = {i: v for i, v in top.items() if v != -np.inf}
            else:
                top.setdefault(token, logprob)
        results.append(SampleResult(token, logprob, top))
    return results
