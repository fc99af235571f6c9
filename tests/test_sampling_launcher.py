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
