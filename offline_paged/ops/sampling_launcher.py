"""Thin typed launchers for cuda/sampling.cu, one per kernel: each checks dtypes, contiguity and shapes,
raises ValueError saying what is wrong, then launches on the current CuPy stream without synchronising.

Legend: R sampled rows, K logits rows, V vocab, Rp penalty rows, P penalty tokens, Q banned pairs,
b bucket slots of a decode graph. `params` rows are PARAMS_WIDTH float64:
(temperature, min_p, greedy, top_p, top_k, 0, 0, 0).
"""
from __future__ import annotations

import cupy
import numpy as np

from offline_paged.ops.kernel_modules import kernel

SOURCE = "sampling.cu"
# Every (source, entry point) launched here (checked against the compiled source by
# tests/test_cuda_compile.py; _kernel refuses anything else).
KERNELS = (
    ("sampling.cu", "prepare_rows"), ("sampling.cu", "count_tokens"), ("sampling.cu", "apply_penalties"),
    ("sampling.cu", "ban_tokens"), ("sampling.cu", "top_cut"), ("sampling.cu", "top_cut_logits"),
    ("sampling.cu", "race"), ("sampling.cu", "race_part"), ("sampling.cu", "race_merge"),
    ("sampling.cu", "gather_row_params"), ("sampling.cu", "chosen_ids"), ("sampling.cu", "apply_token_bitmask"),
    ("sampling.cu", "top_cut_logits_masked"), ("sampling.cu", "race_part_masked"), ("sampling.cu", "race_merge_masked"),
)
BLOCK = 1024  # threads per row block (sampling.cu's BLOCK)
RACE_SPLIT = 8  # blocks per row of race_logits' first launch (sampling.cu's RACE_SPLIT)
PARAMS_WIDTH = 8
_GRID_STRIDE_BLOCKS = 256


def _kernel(filename: str, name: str):
    if (filename, name) not in KERNELS:
        raise RuntimeError(f"{filename}:{name} is not declared in sampling_launcher.KERNELS")
    return kernel(filename, name)


def _check(name: str, a, dtype, shape: tuple) -> None:
    """`a` is a C-contiguous cupy array of `dtype`; `shape` entries of None match any size. (Called a dozen
    times per decode step: the messages are formatted only on failure.)"""
    if not isinstance(a, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if a.ndim != len(shape) or any(w is not None and w != s for w, s in zip(shape, a.shape)):
        raise ValueError(f"{name} must have shape {tuple('*' if w is None else w for w in shape)}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")


def prepare_rows(logits, rows, adjusted, raw_stats) -> None:
    """adjusted[r] = float64(logits[rows[r]]); raw_stats[r] = (max, logsumexp - max) of that row (the
    race computes the same two numbers, bit for bit, for the sampled token's logprob)."""
    _check("logits", logits, np.float32, (None, None))
    _check("rows", rows, np.int32, (None,))
    num_rows, vocab = rows.shape[0], logits.shape[1]
    _check("adjusted", adjusted, np.float64, (num_rows, vocab))
    _check("raw_stats", raw_stats, np.float64, (num_rows, 2))
    if num_rows:
        _kernel(SOURCE, "prepare_rows")((num_rows,), (BLOCK,), (logits, rows, adjusted, raw_stats, np.int32(vocab)))


def count_tokens(tokens, seen, counts) -> None:
    """seen[slot, t] = 1 and counts[slot, t] += is_output for each (slot, t, is_output) row of tokens [P, 3]."""
    _check("tokens", tokens, np.int32, (None, 3))
    _check("seen", seen, np.int32, (None, None))
    _check("counts", counts, np.int32, seen.shape)
    if tokens.shape[0]:
        blocks = min(_GRID_STRIDE_BLOCKS, -(-tokens.shape[0] // 256))
        _kernel(SOURCE, "count_tokens")((blocks,), (256,), (tokens, seen, counts, np.int32(tokens.shape[0]),
                                                           np.int32(seen.shape[1])))


def apply_penalties(adjusted, penalty_rows, penalties, seen, counts) -> None:
    """Repetition / frequency / presence penalties on the rows penalty_rows[slot] of adjusted [R, V]."""
    _check("adjusted", adjusted, np.float64, (None, None))
    _check("penalty_rows", penalty_rows, np.int32, (None,))
    num_slots, vocab = penalty_rows.shape[0], adjusted.shape[1]
    _check("penalties", penalties, np.float64, (num_slots, 3))
    _check("seen", seen, np.int32, (num_slots, vocab))
    _check("counts", counts, np.int32, (num_slots, vocab))
    if num_slots:
        _kernel(SOURCE, "apply_penalties")((-(-vocab // 256), num_slots), (256,),
                                          (adjusted, penalty_rows, penalties, seen, counts, np.int32(vocab)))


def ban_tokens(adjusted, pairs) -> None:
    """adjusted[row, token] = -inf for each (row, token) of pairs [Q, 2]."""
    _check("adjusted", adjusted, np.float64, (None, None))
    _check("pairs", pairs, np.int32, (None, 2))
    if pairs.shape[0]:
        blocks = min(_GRID_STRIDE_BLOCKS, -(-pairs.shape[0] // 256))
        _kernel(SOURCE, "ban_tokens")((blocks,), (256,), (adjusted, pairs, np.int32(pairs.shape[0]),
                                                         np.int32(adjusted.shape[1])))


def apply_token_bitmask(adjusted, mask_rows, bitmask) -> None:
    """adjusted[mask_rows[s], t] = -inf wherever bit t of bitmask[s] (packed int32, [Rm, W]) is clear, and for
    every t >= 32 W: the structured-output mask, sampler.apply_token_bitmasks on the device."""
    _check("adjusted", adjusted, np.float64, (None, None))
    _check("mask_rows", mask_rows, np.int32, (None,))
    _check("bitmask", bitmask, np.int32, (mask_rows.shape[0], None))
    num_slots, vocab = mask_rows.shape[0], adjusted.shape[1]
    if num_slots:
        _kernel(SOURCE, "apply_token_bitmask")((-(-vocab // 256), num_slots), (256,),
                                              (adjusted, mask_rows, bitmask, np.int32(bitmask.shape[1]),
                                               np.int32(vocab)))


def top_cut(adjusted, params, cut) -> None:
    """cut[r] = the scaled-logit threshold of top-k then top-p of row r of adjusted [R, V] (-inf where the
    row is greedy or has neither). No sort and no allocation: capturable in a CUDA graph."""
    _check("adjusted", adjusted, np.float64, (None, None))
    num_rows, vocab = adjusted.shape
    _check("params", params, np.float64, (num_rows, PARAMS_WIDTH))
    _check("cut", cut, np.float64, (num_rows,))
    if num_rows:
        _kernel(SOURCE, "top_cut")((num_rows,), (BLOCK,), (adjusted, params, cut, np.int32(vocab)))


def top_cut_logits(logits, rows, params, cut, bitmask=None) -> None:
    """top_cut of the rows float64(logits[rows[r]]) read in place: the decode graph's sampler, whose rows
    have no penalties or bans, needs no [R, V] float64 copy. bitmask [R, W] int32: row r's structured-output
    mask applied as apply_token_bitmask would (the masked graph's sampler)."""
    _check("logits", logits, np.float32, (None, None))
    _check("rows", rows, np.int32, (None,))
    num_rows, vocab = rows.shape[0], logits.shape[1]
    _check("params", params, np.float64, (num_rows, PARAMS_WIDTH))
    _check("cut", cut, np.float64, (num_rows,))
    if not num_rows:
        return
    if bitmask is None:
        _kernel(SOURCE, "top_cut_logits")((num_rows,), (BLOCK,), (logits, rows, params, cut, np.int32(vocab)))
        return
    _check("bitmask", bitmask, np.int32, (num_rows, None))
    _kernel(SOURCE, "top_cut_logits_masked")((num_rows,), (BLOCK,), (logits, rows, bitmask, np.int32(bitmask.shape[1]),
                                                                     params, cut, np.int32(vocab)))


def gather_row_params(slot_rows, sample_positions, row_params, row_seeds, params, seeds, positions) -> None:
    """Bucket slot i's (params, seed, position) from persistent row slot_rows[i] (-1: a greedy padding slot)."""
    _check("slot_rows", slot_rows, np.int32, (None,))
    num_slots = slot_rows.shape[0]
    _check("sample_positions", sample_positions, np.int32, (num_slots,))
    _check("row_params", row_params, np.float64, (None, PARAMS_WIDTH))
    _check("row_seeds", row_seeds, np.uint64, (row_params.shape[0],))
    _check("params", params, np.float64, (num_slots, PARAMS_WIDTH))
    _check("seeds", seeds, np.uint64, (num_slots,))
    _check("positions", positions, np.uint64, (num_slots,))
    if num_slots:
        _kernel(SOURCE, "gather_row_params")((-(-num_slots // 256),), (256,), (
            slot_rows, sample_positions, row_params, row_seeds, params, seeds, positions, np.int32(num_slots)))


def chosen_ids(out, token_ids) -> None:
    """token_ids[r] = int(out[r, 0]): the race's chosen ids as the next step's int32 input ids."""
    _check("out", out, np.float64, (None, 2))
    _check("token_ids", token_ids, np.int32, (out.shape[0],))
    if out.shape[0]:
        _kernel(SOURCE, "chosen_ids")((-(-out.shape[0] // 256),), (256,), (out, token_ids, np.int32(out.shape[0])))


def _check_race(num_rows: int, vocab: int | None, cut, logits, rows, params, seeds, positions, out) -> None:
    """The race's shared inputs; vocab None: any logits width."""
    _check("cut", cut, np.float64, (num_rows,))
    _check("logits", logits, np.float32, (None, vocab))
    _check("rows", rows, np.int32, (num_rows,))
    _check("params", params, np.float64, (num_rows, PARAMS_WIDTH))
    _check("seeds", seeds, np.uint64, (num_rows,))
    _check("positions", positions, np.uint64, (num_rows,))
    _check("out", out, np.float64, (num_rows, 2))


def race(adjusted, cut, logits, rows, params, seeds, positions, out) -> None:
    """out[r] = (token id, raw logprob): greedy argmax or the exponential race after min-p over the row
    adjusted[r]; the raw logprob from logits[rows[r]] (see sampling.cu)."""
    _check("adjusted", adjusted, np.float64, (None, None))
    num_rows, vocab = adjusted.shape
    _check_race(num_rows, vocab, cut, logits, rows, params, seeds, positions, out)
    if num_rows:
        _kernel(SOURCE, "race")((num_rows,), (BLOCK,), (adjusted, cut, logits, rows, params, seeds, positions,
                                                       out, np.int32(vocab)))


def race_logits(cut, logits, rows, params, seeds, positions, out, bitmask=None) -> None:
    """`race` over the rows float64(logits[rows[r]]) read in place (the decode graph's sampler): the same
    tokens and logprobs as `race` on a copy of those rows (each row over RACE_SPLIT blocks, then one block merges
    them). bitmask [R, W] int32: as in top_cut_logits (the same as `race` on a copy masked by apply_token_bitmask;
    the raw logprob stays the unmasked row's)."""
    _check("rows", rows, np.int32, (None,))
    num_rows = rows.shape[0]
    _check_race(num_rows, None, cut, logits, rows, params, seeds, positions, out)
    if not num_rows:
        return
    vocab = np.int32(logits.shape[1])
    part_stats = cupy.empty((num_rows, BLOCK, 2), dtype=cupy.float32)  # each row thread's (max, sum)
    part_key = cupy.empty((num_rows, RACE_SPLIT), dtype=cupy.float64)  # each part's best key
    part_index = cupy.empty((num_rows, RACE_SPLIT), dtype=cupy.int32)  # and its token
    head, tail = (cut, logits, rows), (params, seeds, positions, part_stats, part_key, part_index)
    if bitmask is not None:
        _check("bitmask", bitmask, np.int32, (num_rows, None))
        head = (*head, bitmask, np.int32(bitmask.shape[1]))
    suffix = "" if bitmask is None else "_masked"
    _kernel(SOURCE, "race_part" + suffix)((RACE_SPLIT, num_rows), (BLOCK // RACE_SPLIT,), (*head, *tail, vocab))
    _kernel(SOURCE, "race_merge" + suffix)((num_rows,), (BLOCK,), (*head, *tail, out, vocab))
