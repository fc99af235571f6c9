"""Mixed-step CUDA graphs (worker/mixed_graphs.py): a prefilling step replayed piecewise (attention between the
pieces) against the eager forward, logits and KV writes, across buckets with padding rows; and the engine with
mixed-step graphs against the engine without (greedy and seeded sampling, chunked prefill, prefix-cache hits,
preemption by recompute and swap, an FP8 KV cache whose scales the first prefill calculates). The bucket logic
is tested on the CPU (test_graph_buckets.py). Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_graphs import DTYPES, ROUNDING, rel_error  # noqa: E402
from test_ops_cuda import GQA4_D128_SHAPE, QWEN3_SHAPE, SMOLLM2_SHAPE, random_weights  # noqa: E402
from test_gpu_engine import engine, prompts, random_model  # noqa: E402
from tiny_engine import run_to_completion  # noqa: E402

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.models.config import LlamaConfig  # noqa: E402
from offline_paged.models.llama import Llama  # noqa: E402
from offline_paged.ops.attention import AttentionMetadata  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402
from offline_paged.worker.mixed_graphs import MixedGraphs  # noqa: E402
from offline_paged.worker.step_inputs import EagerBatch  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 512, 16
WINDOW_SHAPE = GQA4_D128_SHAPE | dict(architecture="MistralForCausalLM", sliding_window=32)


def mixed_step(rng, num_decodes: int, chunks: list[tuple[int, int]], free_blocks: list[int], vocab_size: int):
    """A step of num_decodes one-token sequences, then one chunk (cached tokens, new tokens) per entry of `chunks`,
    each on blocks of its own. Returns host arrays (ids, positions, slots [T], tables [S, M], context lens [S],
    query_start_loc [S + 1])."""
    seqs = [(int(n), 1) for n in rng.integers(1, 300, num_decodes)] + chunks  # (cached, new)
    tables, ids, positions, slots = [], [], [], []
    for cached, new in seqs:
        table = [free_blocks.pop() for _ in range(-(-(cached + new) // BLOCK_SIZE))]
        tables.append(table)
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        ids += rng.integers(0, vocab_size, new).tolist()
    width = max(map(len, tables))
    padded = np.array([t + [0] * (width - len(t)) for t in tables])  # [S, M]
    lens = np.array([cached + new for cached, new in seqs])  # [S]
    starts = np.concatenate([[0], np.cumsum([new for _, new in seqs])])  # [S + 1]
    return np.array(ids), np.array(positions), np.array(slots), padded, lens, starts


def step_batch(step, num_decodes: int, pad_to: int | None = None) -> EagerBatch:
    """The step's EagerBatch on the device (ids, positions and slots padded as pack_eager pads them); its logits
    rows are each sequence's last row."""
    ids, positions, slots, tables, lens, starts = step
    padding = 0 if pad_to is None else pad_to - len(ids)
    i32 = lambda a: cupy.asarray(np.asarray(a), dtype=cupy.int32)  # noqa: E731
    meta = AttentionMetadata(slot_mapping=i32(np.pad(slots, (0, padding), constant_values=-1)),
                             block_tables=i32(tables), context_lens=i32(lens), query_start_loc=i32(starts),
                             max_query_len=int(np.diff(starts).max()), max_context_len=int(lens.max()),
                             num_leading_decodes=num_decodes if np.diff(starts).max() > 1 else 0)
    return EagerBatch(i32(np.pad(ids, (0, padding))), i32(np.pad(positions, (0, padding))), meta,
                      i32(starts[1:] - 1), list(range(len(lens))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SMOLLM2_SHAPE, QWEN3_SHAPE, WINDOW_SHAPE], ids=["llama", "qwen3", "window32"])
def test_mixed_step_replay_matches_the_eager_forward_across_buckets(shape, dtype):
    config = LlamaConfig(**shape | dict(num_hidden_layers=3))
    model = Llama(config, random_weights(config, seed=7), CudaOps(), dtype)
    rng = np.random.default_rng(1)
    kv_cache = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)  # [L, 2, N, B, Hkv, D]
    kv_cache[...] = cupy.asarray(rng.standard_normal(kv_cache.shape).astype(dtype))  # a "cached" past
    graphs = MixedGraphs(model, kv_cache, buckets=(32, 64, 128))
    free_blocks = rng.permutation(NUM_BLOCKS).tolist()
    # 30 tokens -> bucket 32; 19 -> 32 again (fewer tokens than the last replay: its tail must not count);
    # 100 -> 128 (a fresh prompt beside decodes, a chunk after a cached prefix); 64 -> 64, no decodes.
    for num_decodes, chunks in [(3, [(40, 27)]), (0, [(70, 19)]), (5, [(0, 60), (33, 35)]), (0, [(0, 64)])]:
        step = mixed_step(rng, num_decodes, chunks, free_blocks, config.vocab_size)
        num_tokens = len(step[0])
        size = graphs.bucket_for(num_tokens)
        before = kv_cache.get()
        kv_eager = kv_cache.copy()
        plain = step_batch(step, num_decodes)
        eager = model.forward(plain.input_ids, plain.positions, kv_eager, plain.meta, plain.logits_indices).get()
        replayed = graphs.run(step_batch(step, num_decodes, pad_to=size), num_tokens, size).get()  # [S, V]
        assert replayed.shape == eager.shape
        # The same kernels; the GEMMs' algorithms may differ, so rounding-order noise at most.
        assert rel_error(replayed, eager) < (1e-2 if dtype == np.float16 else 5e-2)
        assert (replayed.argmax(-1) == eager.argmax(-1)).mean() >= 0.8
        written = np.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=bool)
        written[step[2]] = True
        flat = lambda a: a.reshape(a.shape[0], 2, -1, *a.shape[4:])  # noqa: E731  [L, 2, N*B, Hkv, D]
        bits = lambda a: a.view(np.uint16)  # noqa: E731
        after, after_eager = kv_cache.get(), kv_eager.get()
        # Padding rows write nothing: every slot the step does not own keeps its bits.
        assert np.array_equal(bits(flat(after)[:, :, ~written]), bits(flat(before)[:, :, ~written]))
        assert rel_error(flat(after)[:, :, written], flat(after_eager)[:, :, written]) < ROUNDING[dtype] * 5
        assert not np.array_equal(bits(flat(after)[:, :, written]), bits(flat(before)[:, :, written]))
    assert graphs.captured_sizes == (32, 64, 128) and graphs.num_replays == 4


def same_outputs(got: dict, want: dict) -> None:
    for key in want:
        a, b = got[key].outputs[0], want[key].outputs[0]
        assert a.token_ids == b.token_ids, key


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_engine_with_mixed_graphs_matches_the_engine_without(dtype):
    """Chunked prefill (a 128-token budget), prefix-cache hits (three prompts share 40 tokens), greedy and seeded
    sampling: the same tokens with mixed-step graphs as with eager prefilling steps."""
    model = random_model(SMOLLM2_SHAPE | dict(num_hidden_layers=4, tie_word_embeddings=False))
    requests = prompts(model.config.vocab_size)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(6)]
    jobs = {f"{k}-greedy": (p, greedy) for k, p in requests.items()}
    jobs |= {f"{k}-seeded": (p, params) for (k, p), params in zip(requests.items(), seeded)}
    mixed = engine(model, "cuda", dtype=dtype)
    with_graphs = run_to_completion(mixed, jobs)
    eager = engine(model, "cuda", dtype=dtype, mixed_graph_tokens=0)
    without = run_to_completion(eager, jobs)
    assert mixed.runner.mixed_graphs.num_replays > 0 and eager.runner.mixed_graphs is None
    assert mixed.stats.num_cached_prompt_tokens > 0  # prefix-cache hits happened
    same_outputs(with_graphs, without)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_runs_with_mixed_graphs_match_those_without(mode):
    model = random_model(SMOLLM2_SHAPE | dict(num_hidden_layers=2, tie_word_embeddings=False))
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, model.config.vocab_size, int(n)).tolist(), params)
                for i, n in enumerate(rng.integers(8, 40, 8))}
    runs = {}
    for tokens in (2048, 0):
        tight = engine(model, "cuda", num_kv_blocks=12, preemption_mode=mode, dtype="float16",
                       mixed_graph_tokens=tokens)
        runs[tokens] = run_to_completion(tight, requests)
        assert tight.stats.num_preemptions > 0
        assert (tight.runner.mixed_graphs is not None and tight.runner.mixed_graphs.num_replays > 0) == bool(tokens)
    same_outputs(runs[2048], runs[0])


def test_fp8_kv_scales_come_from_an_eager_first_prefill_then_graphs_replay():
    """calculate_kv_scales: the first prefill runs eagerly (a replay would keep the scales at 1.0); later
    prefilling steps replay. Scales and tokens equal the engine without mixed-step graphs."""
    model = random_model(SMOLLM2_SHAPE | dict(num_hidden_layers=2))
    requests = prompts(model.config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results, scales = {}, {}
    for tokens in (2048, 0):
        fp8 = engine(model, "cuda", dtype="float16", kv_cache_dtype="fp8", calculate_kv_scales=True,
                     mixed_graph_tokens=tokens)
        results[tokens] = run_to_completion(fp8, {k: (p, params) for k, p in requests.items()})
        scales[tokens] = [(layer.kv_scales.k_scale, layer.kv_scales.v_scale) for layer in fp8.runner.model.layers]
        if tokens:
            assert fp8.runner.mixed_graphs.num_replays > 0
    assert scales[2048] == scales[0] and all(k != 1.0 and v != 1.0 for k, v in scales[0])
    same_outputs(results[2048], results[0])
