"""CUDA graphs for decode steps (worker/cuda_graph_runner.py): graph-replayed decode logits and KV writes
against the eager forward across buckets with padding rows, and the engine with graphs against the
engine without; in fp16 and bf16. The GEMM is tested in test_graphs.py, the decode-input kernels in
test_step_inputs_launcher.py. Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (bf16 arrays; a GPU run without it must fail, not skip)
pytestmark = pytest.mark.gpu

from test_graphs import BF16, DTYPES, ROUNDING, rel_error  # noqa: E402
from test_ops_cuda import QWEN2_SHAPE, QWEN3_SHAPE, SMOLLM2_SHAPE, random_weights  # noqa: E402
from graph_rows import StepRows  # noqa: E402
from test_gpu_engine import engine, prompts, random_model  # noqa: E402
from tiny_engine import run_to_completion  # noqa: E402

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.models.config import LlamaConfig  # noqa: E402
from offline_paged.models.llama import Llama  # noqa: E402
from offline_paged.ops.attention import AttentionMetadata  # noqa: E402
from offline_paged.ops.graphs import CublasGemm  # noqa: E402
from offline_paged.ops.logits_rows import logits_buckets, logits_rows  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402
from offline_paged.worker.cuda_graph_runner import DecodeGraphs  # noqa: E402




@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_writes_the_fp32_accumulator(tied, dtype):
    """Logits for evaluation: fp16 / bf16 inputs, fp32 accumulate, fp32 out. Against float64 on the same
    input values the error is far below what rounding the logits to the dtype costs (eager CudaOps and
    the capture-safe GEMM alike)."""
    from offline_paged.ops.ops_cuda import CudaOps

    rng = np.random.default_rng(5)
    x = cupy.asarray(rng.standard_normal((48, 576)).astype(dtype))  # [K, E]
    w = rng.standard_normal((2000, 576)).astype(dtype)  # [V, E]
    w_dev = cupy.asarray(w).T if tied else cupy.asarray(np.ascontiguousarray(w.T))  # [E, V]
    truth = x.get().astype(np.float64) @ w.T.astype(np.float64)  # [K, V]
    rounded = rel_error((x @ w_dev).get(), truth)  # the output rounded to the dtype
    eager = CudaOps().logits(x, w_dev)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        captured = CublasGemm(stream)(x, w_dev, out_dtype=np.float32)
        stream.synchronize()
    with stream:
        target = cupy.full((60, 2000), np.nan, dtype=cupy.float32)  # a shared buffer: write its first 48 rows
        written = CublasGemm(stream)(x, w_dev, out_dtype=np.float32, out=target[:48])
        stream.synchronize()
    assert written.data.ptr == target.data.ptr and np.isnan(target[48:].get()).all()
    for logits in (eager, captured, written):
        assert logits.dtype == cupy.float32 and logits.shape == (48, 2000)
        error = rel_error(logits.get(), truth)
        assert error < 2e-5 and error * 10 < rounded, (error, rounded)
    with pytest.raises(ValueError, match="out must be"):
        CublasGemm(stream)(x, w_dev, out_dtype=np.float32, out=target[:47])


@pytest.mark.parametrize("num_rows", [1, 7, 9, 100, 257, 300])
def test_eager_lm_head_runs_on_a_row_bucket_and_returns_the_rows_asked_for(num_rows):
    """CudaOps.logits runs its GEMM on logits_rows(K) rows, a few shapes whose cuBLAS kernels warm_logits loads
    at start (a shape needing an unloaded kernel blocks the host until the device is idle); the K rows it
    returns match float64 on the same inputs whatever the padding rows held."""
    rng = np.random.default_rng(num_rows)
    x = cupy.asarray(rng.standard_normal((num_rows, 256)).astype(np.float16))  # [K, E]
    w = rng.standard_normal((256, 1000)).astype(np.float16)  # [E, V]
    ops = CudaOps()
    ops.warm_logits(cupy.asarray(w), 300)
    gemm, seen = ops._logits_gemm, []
    ops._logits_gemm = lambda hidden, lm_head, **kwargs: seen.append(hidden.shape[0]) or gemm(hidden, lm_head, **kwargs)
    cupy.get_default_memory_pool().malloc(1 << 20).memset(0xFF, 1 << 20)  # NaN-ish bytes where padding may land
    logits = ops.logits(x, cupy.asarray(w))
    truth = x.get().astype(np.float64) @ w.astype(np.float64)  # [K, V]
    assert seen == [logits_rows(num_rows)] and logits_rows(num_rows) in logits_buckets(300)
    assert logits.shape == (num_rows, 1000) and logits.dtype == cupy.float32 and logits.flags.c_contiguous
    assert rel_error(logits.get(), truth) < 2e-5


def decode_inputs(rng, num_seqs: int, free_blocks: list[int], block_size: int):
    """Sequences of random context length (some past one attention split) on disjoint blocks; the step
    computes each one's last position. Returns (ids, positions, slots, tables) on the host."""
    lens = rng.integers(1, 700, num_seqs)  # [S] context lengths after this step
    tables = []
    for n in lens:
        count = -(-int(n) // block_size)
        tables.append([free_blocks.pop() for _ in range(count)])
    positions = lens - 1  # [S]
    slots = np.array([t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)])  # [S]
    ids = rng.integers(0, 49152, num_seqs)  # [S]
    return ids, positions, slots, tables


def eager_decode(model, kv_cache, ids, positions, slots, tables):
    """Llama.forward on the same step: logits [S, V] float32 (host)."""
    num_seqs, width = len(tables), max(map(len, tables))
    padded = np.zeros((num_seqs, width), dtype=np.int64)  # [S, M]
    for row, table in zip(padded, tables):
        row[:len(table)] = table
    i32 = lambda a: cupy.asarray(np.asarray(a), dtype=cupy.int32)  # noqa: E731
    meta = AttentionMetadata(slot_mapping=i32(slots), block_tables=i32(padded), context_lens=i32(positions + 1),
                             query_start_loc=i32(np.arange(num_seqs + 1)), max_query_len=1,
                             max_context_len=int(positions.max()) + 1)
    return model.forward(i32(ids), i32(positions), kv_cache, meta, i32(np.arange(num_seqs))).get()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SMOLLM2_SHAPE, QWEN2_SHAPE, QWEN3_SHAPE], ids=["llama", "qwen2", "qwen3"])
def test_graph_decode_matches_eager_across_buckets_with_padding_rows(shape, dtype):
    config = LlamaConfig(**shape | dict(num_hidden_layers=4))
    model = Llama(config, random_weights(config, seed=7), CudaOps(), dtype)
    block_size, rng = 16, np.random.default_rng(0)
    kv_cache = model.allocate_kv_cache(1024, block_size)  # [L, 2, N, B, Hkv, D]
    assert kv_cache.dtype == dtype
    kv_cache[...] = cupy.asarray(rng.standard_normal(kv_cache.shape).astype(dtype))  # a "cached" past
    graphs = DecodeGraphs(model, kv_cache, block_size, max_model_len=1024)
    free_blocks = rng.permutation(1024).tolist()
    step_rows = StepRows(block_size, max_blocks=64)
    # 3 -> bucket 4 (one pad row), 4 -> bucket 4 again (its graph replayed on new inputs), 13 -> 16 (three).
    # The block tables reach the graph through the device mirror of the persistent rows (grown on the way).
    for num_seqs in (3, 4, 13):
        ids, positions, slots, tables = decode_inputs(rng, num_seqs, free_blocks, block_size)
        writes = np.ones(num_seqs, dtype=bool)
        writes[1] = False  # a recomputed cached token: its K/V is not rewritten
        slots = np.where(writes, slots, -1)
        rows = step_rows.step(tables, positions)
        before = kv_cache.get()
        kv_eager = kv_cache.copy()
        eager = eager_decode(model, kv_eager, ids, positions, slots, tables)  # [S, V]
        replayed = graphs.run(ids, positions, rows, writes, step_rows.table_rows)[:num_seqs].get()  # [S, V]
        # Same kernels and GEMM algorithms, so the differences are rounding-order noise at most.
        assert rel_error(replayed, eager) < (1e-2 if dtype == np.float16 else 5e-2)
        assert (replayed.argmax(-1) == eager.argmax(-1)).mean() >= 0.9
        after, after_eager = kv_cache.get(), kv_eager.get()
        flat = lambda a: a.reshape(a.shape[0], 2, -1, *a.shape[4:])  # noqa: E731  [L, 2, N*B, Hkv, D]
        written = np.zeros(1024 * block_size, dtype=bool)
        written[slots[slots >= 0]] = True
        # Slots nobody wrote are bit-identical (padding rows write nothing); written ones match eager.
        bits = lambda a: a.view(np.uint16)  # noqa: E731  (bit-exact comparison for either dtype)
        assert np.array_equal(bits(flat(after)[:, :, ~written]), bits(flat(before)[:, :, ~written]))
        assert rel_error(flat(after)[:, :, written], flat(after_eager)[:, :, written]) < ROUNDING[dtype] * 5
        assert not np.array_equal(bits(flat(after)[:, :, written]), bits(flat(before)[:, :, written]))
    assert graphs.captured_sizes == (4, 16)
    assert graphs.num_replays == 3


def test_capture_all_captures_every_bucket_and_their_shared_logits_stay_right():
    """capture_all captures every bucket up front; the buckets' LM heads share one logits buffer, and
    replays of different sizes in turn (16, 4, 16, 1) still give the eager logits, read after each replay."""
    config = LlamaConfig(**SMOLLM2_SHAPE | dict(num_hidden_layers=3))
    model = Llama(config, random_weights(config, seed=11), CudaOps(), np.float16)
    block_size, rng = 16, np.random.default_rng(4)
    kv_cache = model.allocate_kv_cache(1024, block_size)  # [L, 2, N, B, Hkv, D]
    kv_cache[...] = cupy.asarray(rng.standard_normal(kv_cache.shape).astype(np.float16))
    graphs = DecodeGraphs(model, kv_cache, block_size, max_model_len=1024, buckets=(1, 4, 16))
    graphs.capture_all()
    assert graphs.captured_sizes == (1, 4, 16) and graphs.num_replays == 0
    free_blocks = rng.permutation(1024).tolist()
    step_rows = StepRows(block_size, max_blocks=64)
    pointers = set()
    for num_seqs in (13, 3, 11, 1):
        ids, positions, slots, tables = decode_inputs(rng, num_seqs, free_blocks, block_size)
        writes = np.zeros(num_seqs, dtype=bool)  # the cache stays as it is: eager sees the same past
        rows = step_rows.step(tables, positions)
        eager = eager_decode(model, kv_cache.copy(), ids, positions, np.full(num_seqs, -1), tables)  # [S, V]
        logits = graphs.run(ids, positions, rows, writes, step_rows.table_rows)
        pointers.add(logits.data.ptr)
        assert rel_error(logits[:num_seqs].get(), eager) < 1e-2
    assert len(pointers) == 1  # one shared buffer
    assert graphs.captured_sizes == (1, 4, 16) and graphs.num_replays == 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_engine_with_cuda_graphs_matches_engine_without(dtype):
    model = random_model(SMOLLM2_SHAPE | dict(num_hidden_layers=6))
    requests = prompts(model.config.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    graphed = engine(model, "cuda", cuda_graphs=True, dtype=dtype)
    with_graphs = run_to_completion(graphed, {k: (p, params) for k, p in requests.items()})
    without = run_to_completion(engine(model, "cuda", cuda_graphs=False, dtype=dtype),
                                {k: (p, params) for k, p in requests.items()})
    assert graphed.backend.dtype.name == dtype and graphed.runner.kv_cache.dtype.name == dtype
    assert graphed.runner.decode_graphs.num_replays > 0
    for key in requests:
        a, b = with_graphs[key].outputs[0], without[key].outputs[0]
        assert a.token_ids == b.token_ids
        chosen_a = [entry[t] for entry, t in zip(a.logprobs, a.token_ids)]
        chosen_b = [entry[t] for entry, t in zip(b.logprobs, b.token_ids)]
        np.testing.assert_allclose(chosen_a, chosen_b, atol=5e-2 if dtype == "float16" else 2e-1)
