"""The FP8 KV cache on the CPU (ops/kv_scales.py, the NumPy write / attention, the engine's kv_cache_dtype).

What is checked: the write stores clip(x / scale, +-448) rounded to e4m3; attention on an FP8 pool equals the
reference on the explicitly dequantized pool; copy and swap move the stored bytes; calculate_kv_scales takes
vLLM's max|k| / 200 and max|v| / 100 from the first batch; the FP8 model equals an fp32 model whose KV write
rounds through e4m3 (so the only difference from fp32 is that rounding); its logits stay within e4m3's
rounding unit of fp32's and its greedy tokens equal fp32's up to near-ties; the same memory holds 4x the
blocks of a float32 pool; bad values are refused by name; a held forward (the CUDA memory profile)
calculates no scales.
"""
from __future__ import annotations

import numpy as np
import pytest
from fixtures_tiny_model import write_tiny_model
from test_attention import _case
from test_preemption import assert_same, summary, workload
from tiny_engine import TinyModel, run_to_completion, tiny_engine, tiny_model

from offline_paged import LLM
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.attention import paged_attention_reference
from offline_paged.ops.attention_fast import paged_attention_fast
from offline_paged.ops.kv_scales import FP8_E4M3, KvScales
from offline_paged.ops.ops_numpy import HostSwapper, NumpyOps

E4M3_UNIT = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative


def _quantize(x, scale):
    return np.clip(x / np.float32(scale), -448, 448).astype(FP8_E4M3)


def test_write_stores_clipped_e4m3_and_skips_negative_slots():
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((5, 2, 8)) * 3).astype(np.float32)  # [T, Hkv, D]
    v = (rng.standard_normal((5, 2, 8)) * 3).astype(np.float32)  # [T, Hkv, D]
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6  # beyond 448 x scale: saturates, never NaN
    k_cache = np.zeros((4, 2, 2, 8), dtype=FP8_E4M3)  # [N, B, Hkv, D]
    v_cache = np.zeros((4, 2, 2, 8), dtype=FP8_E4M3)
    slots = np.array([3, 0, -1, 7, 5])
    NumpyOps().write_kv(k, v, k_cache, v_cache, slots, KvScales(k_scale=0.5, v_scale=2.0))
    flat_k, flat_v = k_cache.reshape(8, 2, 8), v_cache.reshape(8, 2, 8)
    kept = slots >= 0
    assert flat_k[slots[kept]].tobytes() == _quantize(k[kept], 0.5).tobytes()
    assert flat_v[slots[kept]].tobytes() == _quantize(v[kept], 2.0).tobytes()
    assert not np.isnan(flat_k.astype(np.float32)).any() and float(flat_k[3, 0, 0]) == 448.0
    untouched = sorted(set(range(8)) - set(slots[kept].tolist()))
    assert not flat_k[untouched].astype(np.float32).any() and not flat_v[untouched].astype(np.float32).any()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", range(3))
def test_attention_on_fp8_equals_the_reference_on_the_dequantized_pool(seed, window):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=4).tolist()
    query_lens = [int(rng.integers(1, n + 1)) if i % 2 else 1 for i, n in enumerate(lengths)]
    q, k_cache, v_cache, meta, _, _ = _case(seed, lengths, query_lens, 4)
    k_scale, v_scale = 0.3, 1.7
    k8, v8 = _quantize(k_cache, k_scale), _quantize(v_cache, v_scale)  # [N, B, Hkv, D] e4m3
    k_deq = k8.astype(np.float32) * np.float32(k_scale)  # what the FP8 pool stands for
    v_deq = v8.astype(np.float32) * np.float32(v_scale)
    want = paged_attention_reference(np, q, k_deq, v_deq, meta, 0.35, window)
    got_ref = paged_attention_reference(np, q, k8, v8, meta, 0.35, window, k_scale, v_scale)
    got_fast = paged_attention_fast(np, q, k8, v8, meta, 0.35, window, k_scale, v_scale)
    ops_out = NumpyOps().attention(q, k8, v8, meta, 0.35, window, kv_scales=KvScales(k_scale, v_scale))
    np.testing.assert_allclose(got_ref, want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got_fast, want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(ops_out, got_fast)


def test_block_copy_and_swap_move_the_stored_bytes():
    rng = np.random.default_rng(1)
    pool = _quantize(rng.standard_normal((2, 2, 6, 4, 2, 8)) * 10, 1.0)  # [L, 2, N, B, Hkv, D] e4m3
    before = pool.copy()
    NumpyOps().copy_blocks(pool, np.array([0, 1]), np.array([4, 5]))
    assert pool[:, :, [4, 5]].tobytes() == before[:, :, [0, 1]].tobytes()
    swapper = HostSwapper(pool, 3)
    assert swapper.cpu_cache.dtype == FP8_E4M3
    swapper.swap_out([2, 3], [0, 2])
    pool[:, :, [2, 3]] = 0
    swapper.swap_in([0, 2], [3, 2])
    assert pool[:, :, [3, 2]].tobytes() == before[:, :, [2, 3]].tobytes()


def test_calculated_scales_come_from_the_first_batch_only():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((6, 2, 8)).astype(np.float32)  # [T, Hkv, D]
    v = rng.standard_normal((6, 2, 8)).astype(np.float32)
    scales = KvScales(calculate=True)
    scales.observe(k[:0], v[:0])  # no rows: nothing to learn from yet
    assert (scales.k_scale, scales.v_scale, scales.calculate) == (1.0, 1.0, True)
    scales.observe(k, v)
    assert scales.k_scale == pytest.approx(np.abs(k).max() / 200) and not scales.calculate
    assert scales.v_scale == pytest.approx(np.abs(v).max() / 100)
    scales.observe(k * 10, v * 10)
    assert scales.k_scale == pytest.approx(np.abs(k).max() / 200)


def test_calculated_scales_ignore_padding_rows():
    k = np.ones((3, 1, 4), dtype=np.float32)  # [T, Hkv, D]
    k[2] = 1e4  # a padding row (slot -1)
    caches = [np.zeros((2, 2, 1, 4), dtype=FP8_E4M3) for _ in range(2)]
    scales = KvScales(calculate=True)
    NumpyOps().write_kv(k, k, *caches, np.array([0, 1, -1]), scales)
    assert scales.k_scale == pytest.approx(1 / 200) and scales.v_scale == pytest.approx(1 / 100)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), True])
def test_bad_scales_are_refused_by_name(value):
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        KvScales(k_scale=value)


class _RoundThroughE4M3(NumpyOps):
    """fp32 ops whose KV write rounds K and V through e4m3 (scale 1) and stores them as fp32."""

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        def rounded(x):
            return np.clip(x, -448, 448).astype(FP8_E4M3).astype(x.dtype)

        super().write_kv(rounded(k), rounded(v), k_cache, v_cache, slot_mapping)


def _smooth_model(seed: int) -> TinyModel:
    """tiny_model with q_proj scaled by 0.1. The random model's attention is very sharp (scores of tens), where
    a 2^-4 rounding of K moves scores by whole units and flips the softmax; scaled down, the model's error is
    what e4m3's rounding of K and V costs, not an amplification of it by an attention no trained model has."""
    model = tiny_model(seed)
    weights = {n: (w * np.float32(0.1) if "q_proj" in n else w) for n, w in model.weights.items()}
    return TinyModel(model.config, weights, model.tokenizer)


def _sequences(seed: int) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(seed)
    return [(i, rng.integers(4, 260, size=40).tolist()) for i in range(3)]


def test_fp8_model_equals_fp32_with_the_kv_rounded_through_e4m3():
    model = tiny_model(0)
    fp8 = Llama(model.config, model.weights, NumpyOps(), kv_cache_dtype=FP8_E4M3)
    rounded = Llama(model.config, model.weights, _RoundThroughE4M3())
    batch = _sequences(0)
    got = SimpleRunner(fp8, 64, 4).step(batch, all_logits=True)
    want = SimpleRunner(rounded, 64, 4).step(batch, all_logits=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("calculate", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_fp8_logits_stay_within_the_e4m3_unit_of_fp32(seed, calculate):
    """Every position's logits (teacher-forced: all_logits over a 40-token prompt reads every earlier K/V from
    the FP8 pool) differ from fp32's by less than 2^-4 of that row's logit range. Measured: <= 0.045."""
    model = _smooth_model(seed)
    fp8 = Llama(model.config, model.weights, NumpyOps(), kv_cache_dtype=FP8_E4M3, calculate_kv_scales=calculate)
    fp32 = Llama(model.config, model.weights, NumpyOps())
    batch = _sequences(seed)
    got = np.concatenate(SimpleRunner(fp8, 64, 4).step(batch, all_logits=True))  # [T, V]
    want = np.concatenate(SimpleRunner(fp32, 64, 4).step(batch, all_logits=True))  # [T, V]
    assert not np.array_equal(got, want)  # the pool really is FP8
    spread = want.max(axis=1) - want.min(axis=1)  # [T]
    assert (np.abs(got - want).max(axis=1) < E4M3_UNIT * spread).all()
    if calculate:
        assert all(layer.kv_scales.k_scale != 1.0 and layer.kv_scales.v_scale != 1.0 for layer in fp8.layers)


def test_fp8_engine_greedy_tokens_equal_fp32_up_to_near_ties():
    """Both engines decode greedily from the same prompts. While their tokens agree, the chosen token's
    logprob differs by less than NEAR; where they first differ, the fp32 engine itself ranks the FP8 engine's
    token within 2 NEAR of its own (a near-tie under e4m3 rounding), and after that the contexts differ and
    nothing more is compared. Measured on this model: |dlogprob| <= 0.13, margins at divergence <= 0.19,
    73 of 96 tokens compared."""
    near = 0.25
    model = _smooth_model(0)
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=20, ignore_eos=True)
    requests = {str(i): (rng.integers(4, 260, size=int(rng.integers(3, 30))).tolist(), params) for i in range(8)}
    outputs = {kv: run_to_completion(tiny_engine(model, dtype="float32", kv_cache_dtype=kv), requests)
               for kv in ("auto", "fp8")}
    matched = 0
    for request_id in requests:
        want, got = outputs["auto"][request_id].outputs[0], outputs["fp8"][request_id].outputs[0]
        for i, (want_id, got_id) in enumerate(zip(want.token_ids, got.token_ids)):
            if want_id != got_id:
                assert want.logprobs[i][want_id] - want.logprobs[i].get(got_id, -np.inf) < 2 * near
                break
            assert abs(want.logprobs[i][want_id] - got.logprobs[i][got_id]) < near
            matched += 1
    assert matched >= len(requests) * 12 // 2  # not vacuous: most tokens are compared


def test_fp8_pool_holds_four_times_the_float32_blocks_in_the_same_memory():
    engines = {kv: tiny_engine(tiny_model(), dtype="float32", kv_cache_dtype=kv, num_kv_blocks=None,
                               kv_cache_memory=1 << 18) for kv in ("auto", "fp8_e4m3")}
    assert engines["fp8_e4m3"].runner.kv_cache.dtype == FP8_E4M3
    assert engines["fp8_e4m3"].runner.kv_cache.nbytes <= 1 << 18
    assert engines["fp8_e4m3"].num_gpu_blocks == 4 * engines["auto"].num_gpu_blocks
    assert engines["fp8_e4m3"].block_manager.num_free_blocks == 4 * engines["auto"].block_manager.num_free_blocks


def test_every_backend_resolves_fp8_to_e4m3():
    """The CUDA backend runs the FP8 KV cache too (its kernels: tests/test_ops_cuda_fp8.py on the GPU)."""
    for backend in ("cpu", "cuda"):
        assert EngineConfig(kv_cache_dtype="fp8").resolved_kv_cache_dtype(backend) == "fp8_e4m3"
        assert EngineConfig(kv_cache_dtype="auto").resolved_kv_cache_dtype(backend) == "auto"


def test_a_held_forward_leaves_calculated_scales_to_the_first_real_prefill():
    """The CUDA engine's memory profile runs a dummy prefill under kv_scales_held: it must not fix the
    scales, and the next forward still calculates them."""
    model = tiny_model()
    fp8 = Llama(model.config, model.weights, NumpyOps(), kv_cache_dtype=FP8_E4M3, calculate_kv_scales=True)
    batch = [(0, list(range(3, 11)))]  # (sequence id, its new tokens)
    with fp8.kv_scales_held():
        SimpleRunner(fp8, 16, 4).step(batch)
    assert all(layer.kv_scales.calculate and layer.kv_scales.k_scale == 1.0 for layer in fp8.layers)
    SimpleRunner(fp8, 16, 4).step(batch)
    assert not any(layer.kv_scales.calculate for layer in fp8.layers)
    assert all(layer.kv_scales.k_scale != 1.0 for layer in fp8.layers)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype must be one of"),
    ({"calculate_kv_scales": "yes"}, "calculate_kv_scales must be True or False"),
    ({"kv_cache_dtype": "fp8", "tensor_parallel_size": 2}, "not supported with tensor_parallel_size"),
])
def test_bad_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_llm_runs_with_an_fp8_kv_cache(tmp_path):
    llm = LLM(str(write_tiny_model(tmp_path / "tiny")), device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True,
              num_kv_blocks=64, block_size=4)
    [output] = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5
    assert llm.engine.runner.kv_cache.dtype == FP8_E4M3


def test_swap_preemption_with_an_fp8_pool_matches_an_ample_fp8_pool():
    """Swapped-out blocks come back byte for byte, so preemption stays invisible with an FP8 pool too."""
    ample = tiny_engine(kv_cache_dtype="fp8", num_kv_blocks=512, max_num_batched_tokens=256)
    want = summary(run_to_completion(ample, workload()))
    tight = tiny_engine(kv_cache_dtype="fp8", num_kv_blocks=24, num_cpu_blocks=256, max_num_batched_tokens=16,
                        preemption_mode="swap")
    got = summary(run_to_completion(tight, workload()))
    assert tight.stats.num_preemptions_swap > 0 and ample.stats.num_preemptions == 0
    assert_same(got, want)
