"""The sampling kernels (ops/sampling_launcher.py) called directly: the sort-free top cut against
NumPy's top-k / top-p sets. The whole GPU sampler is tested in test_gpu_sampler.py. Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from test_gpu_sampler import _logits  # noqa: E402


@pytest.mark.parametrize("rounded", [False, True])
def test_sort_free_top_cut_keeps_numpys_top_k_top_p_sets(rounded):
    """top_cut (a bitwise descent, no sort: capturable) keeps exactly the tokens NumPy's top-k then top-p
    keep, ties included, with banned (-inf) entries and greedy / unfiltered rows getting -inf."""
    from offline_paged.ops import sampling_launcher as kernels
    from offline_paged.worker.sampler import _top_k, _top_p
    from offline_paged.worker.sampling_rows import pack_params

    rng = np.random.default_rng(9)
    num_rows, vocab = 300, 3000
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])), top_k=int(rng.choice([0, 1, 7, 400])),
                             top_p=float(rng.choice([1.0, 0.2, 0.9, 0.999]))) for _ in range(num_rows)]
    adjusted = _logits(num_rows, vocab, rng, rounded).astype(np.float64)  # [R, V]
    adjusted[rng.random(adjusted.shape) < 0.05] = -np.inf  # bans / penalties already applied
    cut = cupy.empty(num_rows, dtype=cupy.float64)
    kernels.top_cut(cupy.asarray(adjusted), cupy.asarray(pack_params(params)), cut)
    cut = cut.get()
    for r, p in enumerate(params):
        if p.temperature == 0.0 or (p.top_k == 0 and p.top_p == 1.0):
            assert cut[r] == -np.inf
            continue
        scaled = adjusted[r] / p.temperature  # [V]
        expected = scaled.copy()
        if p.top_k > 0:
            _top_k(expected, p.top_k)
        if p.top_p < 1.0:
            _top_p(expected, p.top_p)
        kept = expected > -np.inf
        np.testing.assert_array_equal(scaled >= cut[r], kept, err_msg=f"row {r}: {p}")


def _race_inputs(rng, num_rows, vocab):
    """Random logits rows picked out of a larger array, and a mix of greedy, temperature, top-k / top-p and
    min-p rows with their seeds and positions (device arrays)."""
    from offline_paged.worker.sampling_rows import pack_params

    logits = _logits(2 * num_rows, vocab, rng)  # [2R, V]
    rows = rng.permutation(2 * num_rows)[:num_rows].astype(np.int32)  # [R]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.6, 1.0, 1.3])),
                             top_k=int(rng.choice([0, 0, 5, 300])), top_p=float(rng.choice([1.0, 1.0, 0.8])),
                             min_p=float(rng.choice([0.0, 0.0, 0.0, 0.05]))) for _ in range(num_rows)]
    seeds = rng.integers(0, 2**63, num_rows, dtype=np.uint64)  # [R]
    positions = rng.integers(0, 4000, num_rows).astype(np.uint64)  # [R]
    return (cupy.asarray(logits), cupy.asarray(rows), cupy.asarray(pack_params(params)), cupy.asarray(seeds),
            cupy.asarray(positions))


@pytest.mark.parametrize("vocab", [49152, 3001])
def test_logits_variants_equal_the_float64_copy_variants_bit_for_bit(vocab):
    """The decode graph's top_cut_logits / race_logits read the fp32 rows in place; on rows with no
    penalties they give exactly what top_cut / race give on prepare_rows' float64 copy, and the sampled
    token's raw logprob carries the bits of prepare_rows' raw stats (what the top logprobs use)."""
    from offline_paged.ops import sampling_launcher as kernels

    rng = np.random.default_rng(vocab)
    num_rows = 96
    logits, rows, params, seeds, positions = _race_inputs(rng, num_rows, vocab)
    adjusted = cupy.empty((num_rows, vocab), dtype=cupy.float64)
    raw_stats = cupy.empty((num_rows, 2), dtype=cupy.float64)
    kernels.prepare_rows(logits, rows, adjusted, raw_stats)
    cut, cut_in_place = cupy.empty(num_rows), cupy.empty(num_rows)
    kernels.top_cut(adjusted, params, cut)
    kernels.top_cut_logits(logits, rows, params, cut_in_place)
    np.testing.assert_array_equal(cut.get(), cut_in_place.get())
    assert np.isfinite(cut.get()).sum() > num_rows // 4  # the top-k / top-p rows got a real cut
    out, out_in_place = cupy.empty((num_rows, 2)), cupy.empty((num_rows, 2))
    kernels.race(adjusted, cut, logits, rows, params, seeds, positions, out)
    kernels.race_logits(cut, logits, rows, params, seeds, positions, out_in_place)
    out, out_in_place, stats = out.get(), out_in_place.get(), raw_stats.get()
    np.testing.assert_array_equal(out, out_in_place)
    tokens = out[:, 0].astype(np.int64)
    raw = logits.get()[rows.get(), tokens].astype(np.float64)  # [R]
    np.testing.assert_array_equal(out[:, 1], (raw - stats[:, 0]) - stats[:, 1])
    host = logits.get()[rows.get()].astype(np.float64)
    reference_lse = np.log(np.exp(host - host.max(1, keepdims=True)).sum(1))  # [R]
    np.testing.assert_allclose(stats[:, 1], reference_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab", [49152, 3001])
def test_masked_logits_variants_equal_the_masked_float64_copy_bit_for_bit(vocab):
    """The masked decode graph's top_cut_logits / race_logits with a bitmask read the fp32 rows in place:
    the same cut, token and raw logprob as prepare_rows -> apply_token_bitmask -> top_cut -> race, for
    dense, sparse, one-token and all-set masks and a mask narrower than the vocabulary (tokens past 32 W
    are refused), and never a refused token."""
    from offline_paged.ops import sampling_launcher as kernels

    rng = np.random.default_rng(vocab + 1)
    num_rows = 96
    logits, rows, params, seeds, positions = _race_inputs(rng, num_rows, vocab)
    words = -(-vocab // 32) - 1  # one word short of the vocabulary: its last tokens are refused
    bits = rng.random((num_rows, 32 * words)) < rng.choice([0.02, 0.3, 0.9], (num_rows, 1))  # [R, 32 W]
    bits[::7] = True  # unconstrained rows (up to 32 W)
    bits[1::9] = False
    bits[1::9, 5] = True  # a grammar that allows one token
    masks = cupy.asarray(np.packbits(bits, axis=1, bitorder="little").view(np.int32))  # [R, W]
    adjusted = cupy.empty((num_rows, vocab), dtype=cupy.float64)
    raw_stats = cupy.empty((num_rows, 2), dtype=cupy.float64)
    kernels.prepare_rows(logits, rows, adjusted, raw_stats)
    kernels.apply_token_bitmask(adjusted, cupy.arange(num_rows, dtype=cupy.int32), masks)
    cut, cut_in_place = cupy.empty(num_rows), cupy.empty(num_rows)
    kernels.top_cut(adjusted, params, cut)
    kernels.top_cut_logits(logits, rows, params, cut_in_place, masks)
    np.testing.assert_array_equal(cut.get(), cut_in_place.get())
    out, out_in_place = cupy.empty((num_rows, 2)), cupy.empty((num_rows, 2))
    kernels.race(adjusted, cut, logits, rows, params, seeds, positions, out)
    kernels.race_logits(cut, logits, rows, params, seeds, positions, out_in_place, masks)
    out, out_in_place = out.get(), out_in_place.get()
    np.testing.assert_array_equal(out, out_in_place)
    tokens = out_in_place[:, 0].astype(np.int64)
    assert all(bits[r, t] for r, t in enumerate(tokens)) and (tokens[1::9] == 5).all()
    unmasked = cupy.empty((num_rows, 2))
    kernels.race_logits(cut, logits, rows, params, seeds, positions, unmasked)
    assert (unmasked.get()[:, 0] != tokens).sum() > num_rows // 4  # the masks changed the draw


@pytest.mark.parametrize("same_thread", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_race_settles_near_ties_below_fp32_resolution_in_float64(same_thread, temperature):
    """Two finalists whose race keys x_i / T - log(-log u_i) differ by ~1e-6 (below what the fp32 filter
    resolves): the kernel must pick the float64 argmax. With same_thread both sit in one thread's strided
    entries (i = j + 1024), which sends that thread down the path that scores its entries again; otherwise each
    is its thread's best and only the finalists are re-scored. The decode graph's race_logits spreads a row's
    threads over several blocks; entries j and j + 1024 stay with one thread there too."""
    from offline_paged.ops import sampling_launcher as kernels
    from offline_paged.worker.random_stream import uniform
    from offline_paged.worker.sampling_rows import pack_params

    rng = np.random.default_rng(int(same_thread) * 10 + int(temperature * 10))
    num_rows, vocab = 200, 5000
    seeds = rng.integers(0, 2**63, num_rows, dtype=np.uint64)
    positions = rng.integers(0, 4000, num_rows).astype(np.uint64)
    logits = (rng.normal(size=(num_rows, vocab)) - 40.0).astype(np.float32)  # far behind the finalists
    expected = np.empty(num_rows, dtype=np.int64)
    for r in range(num_rows):
        gumbel = np.log(-np.log(uniform(seeds[r], positions[r], np.arange(vocab, dtype=np.uint64))))  # [V]
        j = int(rng.integers(0, vocab - 1024))
        k = j + 1024 if same_thread else int(rng.choice([i for i in range(j + 1, j + 40) if i % 1024 != j % 1024]))
        logits[r, j] = np.float32((gumbel[j] + 5.0) * temperature)
        target = logits[r, j] / temperature - gumbel[j]  # j's key
        logits[r, k] = np.float32((target + gumbel[k] + rng.uniform(-3e-6, 3e-6)) * temperature)
        keys = logits[r].astype(np.float64) / temperature - gumbel  # [V]
        assert abs(keys[j] - keys[k]) < 2e-5 * abs(keys[j]) + 1e-5 and keys[j] != keys[k]
        expected[r] = int(np.argmax(keys))
    params = pack_params([SamplingParams(temperature=temperature)] * num_rows)
    out = cupy.empty((num_rows, 2))
    kernels.race_logits(cupy.full(num_rows, -np.inf), cupy.asarray(logits), cupy.arange(num_rows, dtype=cupy.int32),
                        cupy.asarray(params), cupy.asarray(seeds), cupy.asarray(positions), out)
    np.testing.assert_array_equal(out.get()[:, 0].astype(np.int64), expected)
