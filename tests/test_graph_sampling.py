"""Sampling inside the decode CUDA graph (needs a GPU).

The graph's sampler runs the eager GpuSampler's kernels on persistent per-row parameters, so on the same
logits it must draw the very same tokens (and raw logprobs, bit for bit), for greedy and seeded
temperature / top-k / top-p / min-p rows, across buckets with padding, rows that change sequence, and row
buffers that grow. In the engine: graph sampling on equals graph sampling off (the eager sampler on the
graph's logits), in the synchronous and the async loop; rows with penalties or logprobs fall back.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from graph_rows import StepRows  # noqa: E402
from test_ops_cuda import SMOLLM2_SHAPE, random_weights  # noqa: E402
from test_gpu_engine import engine, random_model  # noqa: E402

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.models.config import LlamaConfig  # noqa: E402
from offline_paged.models.llama import Llama  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402
from offline_paged.worker.cuda_graph_runner import DecodeGraphs  # noqa: E402
from offline_paged.worker.gpu_sampler import GpuSampler  # noqa: E402
from offline_paged.worker.sampler import SamplingRequest  # noqa: E402
from offline_paged.worker.sampling_rows import SamplingRows  # noqa: E402

MIXED = [
    SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.6),
    SamplingParams(top_k=20), SamplingParams(top_k=1), SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.5, top_p=0.3), SamplingParams(min_p=0.1),
    SamplingParams(temperature=1.3, top_k=50, top_p=0.8, min_p=0.02),
]


def _decode_step(rng, num_seqs, free_blocks, block_size):
    lens = rng.integers(1, 500, num_seqs)  # [S] context lengths after this step
    tables = [[free_blocks.pop() for _ in range(-(-int(n) // block_size))] for n in lens]
    positions = lens - 1  # [S]
    slots = np.array([t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)])
    return rng.integers(0, 49152, num_seqs), positions, slots, tables


@pytest.fixture(scope="module")
def graphs():
    config = LlamaConfig(**SMOLLM2_SHAPE | dict(num_hidden_layers=3))
    model = Llama(config, random_weights(config, seed=3), CudaOps(), np.float16)
    kv_cache = model.allocate_kv_cache(4096, 16)  # [L, 2, N, B, Hkv, D]
    kv_cache[...] = cupy.asarray(np.random.default_rng(1).standard_normal(kv_cache.shape).astype(np.float16))
    return DecodeGraphs(model, kv_cache, 16, max_model_len=512)


def _sampled_step(graphs, rng, step, step_rows, sampling_rows, seq_ids, owner_params):
    """One decode step (ids, positions, tables) of seq_ids sampled in the graph at random output positions, each
    row with its owner's (params, seed): (the PendingSamples, their results, the eager GpuSampler's results on
    the same logits)."""
    ids, positions, tables = step
    num_seqs = len(seq_ids)
    rows = step_rows.step(tables, positions, seq_ids)  # [S]
    sampling_rows.update(rows, np.asarray(seq_ids, np.int64), lambda i: (*owner_params[seq_ids[i]], False))
    sample_positions = rng.integers(0, 3000, num_seqs)  # [S]
    logits, samples = graphs.run_and_sample(ids, positions, rows, np.ones(num_seqs, bool), step_rows.table_rows,
                                            sample_positions, sampling_rows)
    got = samples.results()
    requests = [SamplingRequest(*owner_params[s], int(p), (), ()) for s, p in zip(seq_ids, sample_positions)]
    expected = GpuSampler((2,)).sample(logits[:num_seqs], list(range(num_seqs)), requests)
    return samples, got, expected


def test_graph_samples_equal_the_eager_sampler_on_the_same_logits(graphs):
    rng = np.random.default_rng(0)
    sampling_rows = SamplingRows(eos_token_ids=(2,), num_rows=4)  # grows below: the sampling graphs recapture
    step_rows = StepRows(16, max_blocks=32)
    free_blocks = rng.permutation(4096).tolist()
    owner_params, live = {}, []
    # Bucket 4 twice, then 16 (rows grow past 4: bucket 4's sampling graph must be recaptured at step 3,
    # or it reads the old buffers), 4 again, 64, 16. About half the sequences stay from step to step
    # (their rows are not repacked), the rest are new.
    for step, num_seqs in enumerate((3, 4, 13, 4, 40, 13)):
        ids, positions, slots, tables = _decode_step(rng, num_seqs, free_blocks, 16)
        kept = [s for s in live if rng.random() < 0.5][:num_seqs]
        seq_ids = kept + list(range(10_000 * (step + 1), 10_000 * (step + 1) + num_seqs - len(kept)))
        for s in seq_ids[len(kept):]:
            owner_params[s] = (MIXED[int(rng.integers(len(MIXED)))], int(rng.integers(0, 2**63)))
        live = seq_ids
        samples, got, expected = _sampled_step(graphs, rng, (ids, positions, tables), step_rows, sampling_rows,
                                               seq_ids, owner_params)
        assert [r.token_id for r in got] == [r.token_id for r in expected], step
        assert [r.logprob for r in got] == [r.logprob for r in expected], step  # same kernels, same bits
        assert samples.token_ids.get().tolist() == [r.token_id for r in got]
        assert all(r.top_logprobs is None for r in got)
    assert sampling_rows.num_rows >= 40
    assert graphs.num_sampled_replays == 6


def test_capture_all_with_sampling_rows_captures_every_sampling_graph_up_front():
    """capture_all(sampling_rows) captures each bucket's sampling graph at start (a lazy capture waits for the
    device to be idle, in the middle of a run); later steps replay those graphs, capture none, and draw what
    the eager sampler draws from the same logits."""
    config = LlamaConfig(**SMOLLM2_SHAPE | dict(num_hidden_layers=2))
    model = Llama(config, random_weights(config, seed=8), CudaOps(), np.float16)
    kv_cache = model.allocate_kv_cache(2048, 16)  # [L, 2, N, B, Hkv, D]
    kv_cache[...] = cupy.asarray(np.random.default_rng(2).standard_normal(kv_cache.shape).astype(np.float16))
    graphs = DecodeGraphs(model, kv_cache, 16, max_model_len=512, buckets=(1, 4, 16))
    sampling_rows = SamplingRows(eos_token_ids=(2,), num_rows=32)
    graphs.capture_all(sampling_rows)
    assert graphs.captured_sizes == (1, 4, 16) and graphs.num_sampling_captures == 3
    rng = np.random.default_rng(12)
    step_rows = StepRows(16, max_blocks=32)
    free_blocks = rng.permutation(2048).tolist()
    for step, num_seqs in enumerate((3, 13, 1)):
        ids, positions, slots, tables = _decode_step(rng, num_seqs, free_blocks, 16)
        seq_ids = list(range(100 * (step + 1), 100 * (step + 1) + num_seqs))
        params = {s: (MIXED[int(rng.integers(len(MIXED)))], int(rng.integers(0, 2**63))) for s in seq_ids}
        _, got, expected = _sampled_step(graphs, rng, (ids, positions, tables), step_rows, sampling_rows, seq_ids,
                                         params)
        assert [(r.token_id, r.logprob) for r in got] == [(r.token_id, r.logprob) for r in expected], step
    assert graphs.num_sampling_captures == 3 and graphs.num_sampled_replays == 3


def test_masked_graph_samples_equal_the_eager_sampler_with_the_same_masks(graphs):
    """Structured output in the graph: sample_masked draws what GpuSampler draws from the same logits
    with the same packed masks (tokens and raw logprobs bit for bit), never a masked token; rows with
    all bits set are unconstrained; a one-token mask forces that token. The first masked sampling captures
    every captured bucket's masked graph at once (each capture waits for the device)."""
    captures_before = graphs.num_masked_captures
    rng = np.random.default_rng(21)
    vocab = 49152
    sampling_rows = SamplingRows(eos_token_ids=(2,), num_rows=8)
    step_rows = StepRows(16, max_blocks=32)
    free_blocks = rng.permutation(4096).tolist()
    for step, num_seqs in enumerate((5, 13, 13, 30)):
        ids, positions, slots, tables = _decode_step(rng, num_seqs, free_blocks, 16)
        seq_ids = list(range(1000 * step, 1000 * step + num_seqs))
        owner = {s: (MIXED[int(rng.integers(len(MIXED)))], int(rng.integers(0, 2**63))) for s in seq_ids}
        rows = step_rows.step(tables, positions, seq_ids)  # [S]
        sampling_rows.update(rows, np.asarray(seq_ids, np.int64), lambda i: (*owner[seq_ids[i]], False))
        sample_positions = rng.integers(0, 3000, num_seqs)  # [S]
        bits = rng.random((num_seqs, vocab)) < 0.03  # [S, V]
        bits[::3] = True  # unconstrained rows
        bits[1::5] = False
        bits[1::5, 77] = True  # a grammar that allows one token only
        masks = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [S, W]
        logits = graphs.run(ids, positions, rows, np.ones(num_seqs, bool), step_rows.table_rows,
                            sample_positions=sample_positions)
        got = graphs.sample_masked(masks, sampling_rows).results()
        if step == 0:
            assert graphs.num_masked_captures - captures_before == len(graphs.captured_sizes) > 1
        requests = [SamplingRequest(*owner[s], int(p), (), (), masks[i])
                    for i, (s, p) in enumerate(zip(seq_ids, sample_positions))]
        expected = GpuSampler((2,)).sample(logits[:num_seqs], list(range(num_seqs)), requests)
        assert [r.token_id for r in got] == [r.token_id for r in expected], step
        assert [r.logprob for r in got] == [r.logprob for r in expected], step
        assert all(bits[i, r.token_id] for i, r in enumerate(got))
        assert all(got[i].token_id == 77 for i in range(1, num_seqs, 5))
    with pytest.raises(RuntimeError, match="needs a replay"):
        graphs.sample_masked(masks, sampling_rows)  # the last run was sampled already
    graphs.run(ids, positions, rows, np.ones(num_seqs, bool), step_rows.table_rows, sample_positions=sample_positions)
    with pytest.raises(ValueError, match="do not fit"):
        graphs.sample_masked(masks[:, :-1], sampling_rows)  # 32 W < V


def test_a_planted_seed_change_changes_the_draw(graphs):
    """The draw reads the row's seed from the device rows: a different seed there moves random rows.
    A random model's logits are so peaked that a temperature near 1 draws the argmax under any seed;
    a very high temperature leaves a near-uniform distribution, where the seed decides."""
    rng = np.random.default_rng(5)
    free_blocks = rng.permutation(4096).tolist()
    ids, positions, slots, tables = _decode_step(rng, 16, free_blocks, 16)
    step_rows = StepRows(16, max_blocks=32)
    rows, sample_positions = step_rows.step(tables, positions), np.full(16, 7)
    writes = np.zeros(16, bool)  # no K/V writes: every replay sees the same cache
    draws = []
    for seed in (1, 2):
        sampling_rows = SamplingRows(num_rows=16)
        sampling_rows.update(rows, np.arange(16) + 100 * seed, lambda i: (SamplingParams(temperature=1e3), seed, False))
        for _ in range(2):  # the same seed twice: the same draw
            draws.append(graphs.run_and_sample(ids, positions, rows, writes, step_rows.table_rows, sample_positions,
                                               sampling_rows)[1].token_ids.get().tolist())
    assert draws[0] == draws[1] and draws[2] == draws[3]
    assert draws[0] != draws[2]


class _FailingSampleCapture(DecodeGraphs):
    """Raises once from inside its first sampling capture, before any kernel is captured: a graph ended
    there is empty, and launching it would leave the samples of the buffers' last writer."""

    failures = 1

    def _sample(self, bucket, masked=False):
        if self.failures and cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr):
            self.failures -= 1
            raise RuntimeError("planted capture failure")
        super()._sample(bucket, masked)


def test_a_failed_sampling_capture_keeps_no_graph_and_the_next_step_captures_again(graphs):
    failing = _FailingSampleCapture(graphs.model, graphs.kv_cache, 16, max_model_len=512, buckets=(16,))
    rng = np.random.default_rng(6)
    free_blocks = rng.permutation(4096).tolist()
    ids, positions, slots, tables = _decode_step(rng, 16, free_blocks, 16)
    step_rows = StepRows(16, max_blocks=32)
    rows, sample_positions, writes = step_rows.step(tables, positions), np.full(16, 3), np.zeros(16, bool)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]
    sampling_rows = SamplingRows(num_rows=16)
    sampling_rows.update(rows, np.arange(16), lambda i: (params[i % 2], 40 + i, False))
    with pytest.raises(RuntimeError, match="planted capture failure"):
        failing.run_and_sample(ids, positions, rows, writes, step_rows.table_rows, sample_positions, sampling_rows)
    # Other input ids: other logits, so samples left over from the failed call's warm-up cannot pass.
    logits, samples = failing.run_and_sample(rng.integers(0, 49152, 16), positions, rows, writes,
                                             step_rows.table_rows, sample_positions, sampling_rows)
    requests = [SamplingRequest(params[i % 2], 40 + i, 3, (), ()) for i in range(16)]
    expected = GpuSampler((2,)).sample(logits[:16], list(range(16)), requests)
    assert [r.token_id for r in samples.results()] == [r.token_id for r in expected]
    assert failing.num_sampled_replays == 1


def _requests(vocab, fallback: str | None):
    rng = np.random.default_rng(17)
    requests = {}
    for i in range(10):
        prompt = rng.integers(0, vocab, int(rng.integers(5, 60))).tolist()
        params = MIXED[i % len(MIXED)]
        params = SamplingParams(**{f: getattr(params, f) for f in ("temperature", "top_k", "top_p", "min_p")},
                                seed=i, max_tokens=int(rng.integers(8, 30)), ignore_eos=True)
        requests[f"r{i}"] = (prompt, params)
    if fallback is not None:  # the longest request: every decode step holds it, so none samples in the graph
        extra = dict(repetition_penalty=1.3) if fallback == "penalty" else dict(logprobs=2)
        requests["slow"] = (rng.integers(0, vocab, 20).tolist(),
                            SamplingParams(temperature=0.9, seed=99, max_tokens=60, ignore_eos=True, **extra))
    return requests


def _run(model, requests, async_scheduling: bool, graph_sampling: bool):
    eng = engine(model, "cuda", dtype="float16", max_model_len=160, cuda_graphs=True,
                 async_scheduling=async_scheduling, max_num_seqs=16)
    if not graph_sampling:  # the eager sampler samples the same graphs' logits
        eng.runner.attach_decode_graphs(eng.runner.decode_graphs, sample_in_graph=False)
    for request_id, (prompt, params) in requests.items():
        eng.add_request(request_id, prompt_token_ids=prompt, params=params)
    results = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            results[out.request_id] = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
    return results, eng.runner.decode_graphs


@pytest.mark.parametrize("fallback", [None, "penalty", "logprobs"])
def test_engine_graph_sampling_equals_eager_sampling_sync_and_async(fallback):
    model = random_model(SMOLLM2_SHAPE | dict(num_hidden_layers=4))
    requests = _requests(model.config.vocab_size, fallback)
    expected, eager_graphs = _run(model, requests, async_scheduling=False, graph_sampling=False)
    assert eager_graphs.num_replays > 0 and eager_graphs.num_sampled_replays == 0
    for async_scheduling in (False, True):
        got, graphs = _run(model, requests, async_scheduling, graph_sampling=True)
        assert got == expected, async_scheduling
        assert graphs.num_replays > 0
        if fallback is None:
            assert graphs.num_sampled_replays > 0
        else:
            assert graphs.num_sampled_replays == 0
