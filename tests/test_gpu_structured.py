"""Structured-output masks on the GPU (needs a GPU; no llguidance: the masks are random packed bitmasks).

The apply_token_bitmask kernel equals the NumPy mask application (sampler.apply_token_bitmasks) bit for bit,
and masked device sampling (GpuSampler) draws what the host Sampler draws, never a masked token."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.ops import sampling_launcher as kernels  # noqa: E402
from offline_paged.worker.gpu_sampler import GpuSampler  # noqa: E402
from offline_paged.worker.sampler import (Sampler, SamplingRequest, apply_token_bitmasks,  # noqa: E402
                                          unpack_bitmask)


def _masks(rng, rows: int, vocab: int, density: float, words: int | None = None) -> np.ndarray:
    words = -(-vocab // 32) if words is None else words
    bits = rng.random((rows, words * 32)) < density  # [R, 32 W]
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [R, W]


@pytest.mark.parametrize("vocab, words", [(49152, None), (49155, None), (1000, 20), (77, 5)])
def test_the_mask_kernel_equals_the_numpy_application(vocab, words):
    rng = np.random.default_rng(vocab)
    adjusted = rng.standard_normal((6, vocab))  # [R, V] float64
    masks = _masks(rng, 4, vocab, 0.3, words)  # [Rm, W]: rows 0, 2, 3, 5 masked
    masked_rows = [0, 2, 3, 5]
    requests = [SamplingRequest(SamplingParams(), 0, 0, (), (), masks[masked_rows.index(r)] if r in masked_rows
                                else None) for r in range(6)]
    want = adjusted.copy()
    apply_token_bitmasks(want, requests)
    got = cupy.asarray(adjusted)
    kernels.apply_token_bitmask(got, cupy.asarray(np.array(masked_rows, np.int32)), cupy.asarray(masks))
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_the_launcher_refuses_a_mask_of_the_wrong_dtype():
    with pytest.raises(ValueError, match="bitmask must be int32"):
        kernels.apply_token_bitmask(cupy.zeros((1, 64)), cupy.zeros(1, cupy.int32), cupy.zeros((1, 2), cupy.int64))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=40),
                                    SamplingParams(temperature=1.2, min_p=0.05, logprobs=3)],
                         ids=["greedy", "random", "top_k+top_p", "min_p+logprobs"])
def test_masked_device_sampling_equals_the_host_reference(params):
    rng = np.random.default_rng(1)
    vocab, rows = 49152, 64
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)  # [R, V]
    masks = _masks(rng, rows, vocab, 0.02)
    masks[::7] = 0
    masks[::7, 0] = 1 << 5  # a row whose grammar allows one token only (id 5)
    requests = [SamplingRequest(params, 1000 + r, r, (1, 2), (), masks[r]) for r in range(rows)]
    want = Sampler((2,)).sample(logits, requests)
    got = GpuSampler((2,)).sample(cupy.asarray(logits), list(range(rows)), requests)
    allowed = unpack_bitmask(masks, vocab)
    assert all(allowed[r, g.token_id] for r, g in enumerate(got))
    assert [g.token_id for g in got] == [w.token_id for w in want]
    np.testing.assert_allclose([g.logprob for g in got], [w.logprob for w in want], rtol=0, atol=1e-4)
    assert all(got[r].token_id == 5 for r in range(0, rows, 7))
