"""paged_attention_fast (ops/attention_fast.py) equals the reference on random mixed prefill/decode batches."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.ops.attention import paged_attention_reference
from offline_paged.ops.attention_fast import paged_attention_fast
from test_attention import _case


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("seed", range(6))
def test_fast_path_equals_reference_on_mixed_batches(seed, dtype, tol):
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, 7))
    lengths = rng.integers(1, 40, size=num_seqs).tolist()
    query_lens = [int(rng.integers(1, n + 1)) if rng.random() < 0.4 else 1 for n in lengths]
    block_size = int(rng.choice([1, 3, 16]))
    q, k_cache, v_cache, meta, _, _ = _case(seed, lengths, query_lens, block_size, dtype)
    want = paged_attention_reference(np, q, k_cache, v_cache, meta, 0.35)
    got = paged_attention_fast(np, q, k_cache, v_cache, meta, 0.35)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
