"""Async scheduling on the GPU: the same requests with the overlapped loop and the synchronous one give
the same tokens, with CUDA graphs on and off, and a tiny pool that preempts (needs a GPU).

Random fp16 weights of the SmolLM2 shape (6 layers). Greedy rows and seeded sampled rows, stop ids that
end most rows early (so lookahead tokens are dropped), and one n=2 request (forks run synchronously).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_gpu_engine import SHAPES, engine, random_model  # noqa: E402

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402

MODEL = random_model(SHAPES["smollm2-d64-gqa3"])


def _requests():
    rng = np.random.default_rng(11)
    vocab = MODEL.config.vocab_size
    requests = {}
    for i in range(14):
        prompt = rng.integers(0, vocab, int(rng.integers(5, 90))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(5, 40)), temperature=0.0 if i % 2 else 0.8,
                                seed=i, n=2 if i == 3 else 1,
                                stop_token_ids=rng.integers(0, vocab, 2000).tolist() if i % 3 == 0 else [])
        requests[f"r{i}"] = (prompt, params)
    return requests


def _run(async_scheduling: bool, cuda_graphs: bool, num_kv_blocks: int):
    eng = engine(MODEL, "cuda", dtype="float16", num_kv_blocks=num_kv_blocks, max_model_len=160,
                 cuda_graphs=cuda_graphs, async_scheduling=async_scheduling)
    assert eng.async_scheduling is async_scheduling
    for request_id, (prompt, params) in _requests().items():
        eng.add_request(request_id, prompt_token_ids=prompt, params=params)
    results = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            results[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
    assert eng.block_manager.num_seqs == 0
    return results, eng.stats.num_preemptions


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("num_kv_blocks", [512, 14])
def test_async_equals_sync_on_the_gpu(cuda_graphs, num_kv_blocks):
    expected, _ = _run(False, cuda_graphs, num_kv_blocks)
    got, preemptions = _run(True, cuda_graphs, num_kv_blocks)
    assert got == expected
    assert (preemptions > 0) == (num_kv_blocks == 14)
