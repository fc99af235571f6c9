"""SamplingRows: the per-row sampling parameters of the persistent batch, packed once per row.

Data structure: host arrays indexed by the runner's persistent rows (BlockTableRows rows): `params`
[R, 8] float64 (temperature, min_p, greedy flag, top_p, top_k, 0, 0, 0: sampling_launcher.PARAMS_WIDTH),
`seeds` [R] uint64, `owners` [R] int64 (the seq id a row was packed for, -1 when never packed), and per
row whether the decode graph may sample it (`samplable`, and `ban_until`: the output position from which
no min_tokens ban applies).
A row is (re)packed only when the sequence holding it changes; `take_dirty()` hands the rows packed
since the last call to whoever mirrors them on the device. Invariant: for every row r with
owners[r] == s, params[r] and seeds[r] are `pack_params` of sequence s's params and sampling seed.

`pack_params` is the one packing both GPU samplers use (the eager GpuSampler per step, the decode graph
per row), so a row's draw is computed from the same numbers on either path. `graph_samplable` says
whether a decode row can be sampled inside the captured graph: greedy or temperature / top-k / top-p /
min-p, with or without a structured-output mask; penalties, logprobs, token constraints, forks, beams and
an active min_tokens ban take the eager sampler.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from offline_paged.core.sampling_params import SamplingParams

PARAMS_WIDTH = 8  # cuda/sampling_launcher.PARAMS_WIDTH (kept here so the engine core imports no cupy)


def pack_params(params: Sequence[SamplingParams]) -> np.ndarray:
    """[R, PARAMS_WIDTH] float64 rows (temperature, min_p, greedy, top_p, top_k, 0, 0, 0)."""
    packed = np.zeros((len(params), PARAMS_WIDTH), dtype=np.float64)  # [R, 8]
    if params:
        fields = np.array([(p.temperature, p.min_p, p.temperature == 0.0, p.top_p, p.top_k) for p in params],
                          dtype=np.float64)  # [R, 5]
        packed[:, :5] = fields
    return packed


def pack_seeds(seeds: Sequence[int]) -> np.ndarray:
    """[R] uint64: each seed modulo 2^64 (random_stream's arithmetic)."""
    return np.array([s & (2**64 - 1) for s in seeds], dtype=np.uint64)


def graph_samplable(params: SamplingParams, beam: bool) -> bool:
    """Whether rows of a request with these params can be sampled by the decode graph's sampler (also
    needs: one sample, no prompt logprobs in the step, and no ban before min_tokens at that position)."""
    if beam or params.logprobs is not None or params.logits_processors:
        return False  # (structured output is: the runner routes those steps to the graph's masked sampler)
    if params.needs_token_history:  # penalties and bad words read the sequence's tokens
        return False
    return params.allowed_token_ids is None and not params.logit_bias


def ban_until(params: SamplingParams, eos_token_ids: Sequence[int]) -> int:
    """Output positions below this one ban EOS / stop ids (min_tokens): the eager sampler applies that."""
    bans = bool(params.stop_token_ids) or (bool(eos_token_ids) and not params.ignore_eos)
    return params.min_tokens if bans else 0


class SamplingRows:
    def __init__(self, eos_token_ids: Sequence[int] = (), num_rows: int = 64) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.params = np.zeros((num_rows, PARAMS_WIDTH), dtype=np.float64)  # [R, 8]
        self.seeds = np.zeros(num_rows, dtype=np.uint64)  # [R]
        self.owners = np.full(num_rows, -1, dtype=np.int64)  # [R]
        self.samplable = np.zeros(num_rows, dtype=bool)  # [R] graph_samplable of the row's params
        self.ban_until = np.zeros(num_rows, dtype=np.int64)  # [R]
        self._dirty: set[int] = set()

    @property
    def num_rows(self) -> int:
        return self.owners.shape[0]

    def update(self, rows: np.ndarray, seq_ids: np.ndarray, describe: Callable[[int], tuple]) -> None:
        """Repack the rows whose sequence changed. rows [S], seq_ids [S] int64; describe(i) -> (SamplingParams,
        seed, is_beam) of the i-th of them, called only for the changed ones."""
        if rows.size and int(rows.max()) >= self.num_rows:
            self._grow(int(rows.max()) + 1)
        changed = np.flatnonzero(self.owners[rows] != seq_ids)  # [c] indices into rows
        if not changed.size:
            return
        described = [describe(i) for i in changed.tolist()]
        target = rows[changed]  # [c]
        self.params[target] = pack_params([params for params, _, _ in described])
        self.seeds[target] = pack_seeds([seed for _, seed, _ in described])
        self.samplable[target] = [graph_samplable(params, beam) for params, _, beam in described]
        self.ban_until[target] = [ban_until(params, self.eos_token_ids) for params, _, _ in described]
        self.owners[target] = seq_ids[changed]
        self._dirty.update(target.tolist())

    def graph_ready(self, rows: np.ndarray, sample_positions: np.ndarray) -> bool:
        """Whether every row (updated this step) can be sampled in the graph at these output positions."""
        return bool(self.samplable[rows].all() and (sample_positions >= self.ban_until[rows]).all())

    def take_dirty(self) -> np.ndarray:
        """Rows packed since the last call, ascending [d] int64 (then forgotten)."""
        dirty = np.array(sorted(self._dirty), dtype=np.int64)  # [d]
        self._dirty.clear()
        return dirty

    def _grow(self, needed: int) -> None:
        size, old = max(needed, 2 * self.num_rows), self.num_rows
        for name, fill in (("params", 0), ("seeds", 0), ("owners", -1), ("samplable", False), ("ban_until", 0)):
            current = getattr(self, name)
            grown = np.full((size,) + current.shape[1:], fill, dtype=current.dtype)
            grown[:old] = current
            setattr(self, name, grown)
