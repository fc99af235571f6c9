"""The engine with an FP8 (e4m3) KV cache on CUDA, on random-weight models of each family (Llama, Qwen3, Mistral
with a sliding window), CUDA graphs on. Needs a GPU.

- Teacher-forced against the CPU engine with the same FP8 cache (fp32 activations, the NumPy FP8 path): the
  GPU's greedy tokens and prompts are scored by the CPU engine; at every position both report the logprob of
  the token that follows, and their top-1 agrees wherever the CPU's top-2 gap is decisive. With
  calculate_kv_scales too (scales != 1 reach every kernel, the decode graphs included: they read the device
  scale buffers the first prefill fills).
- Greedy against the 16-bit GPU engine: tokens equal up to near-ties under e4m3 rounding (NEAR, calibrated
  on the CPU: fp32 vs FP8 engines on these models differ by <= 0.49 in a chosen token's logprob and first
  diverge where fp32's own top-2 gap is <= 1.44, with these seeds).
- The pool holds twice the 16-bit blocks in the same memory; swap preemption with an FP8 pool moves bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_gpu_engine import SHAPES, engine, prompts, random_model, top2  # noqa: E402
from teacher_forcing import teacher_forced  # noqa: E402
from tiny_engine import run_to_completion  # noqa: E402

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402

FAMILIES = {"llama": SHAPES["smollm2-d64-gqa3"] | dict(num_hidden_layers=4, tie_word_embeddings=False),
            "qwen3": SHAPES["qwen3"], "mistral-window32": SHAPES["mistral-window32"]}
# (top-2 gap / scale that counts as decisive, least share of decisive positions, largest target-logprob
# error / scale): the 16-bit test's fp16 bounds widened for the GPU quantizing fp16-rounded K/V where the
# CPU quantizes fp32 (an e4m3 rounding may land one step apart).
FP8_BOUNDS = (1e-2, 0.6, 6e-2)
NEAR = 1.0  # logprob units; see the module docstring


@pytest.mark.parametrize("calculate", [False, True], ids=["scales-1", "calculated-scales"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp8_gpu_engine_matches_the_cpu_fp8_engine_teacher_forced(name, calculate):
    model = random_model(FAMILIES[name])
    requests = prompts(model.config.vocab_size)
    gen = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    # A 32-token budget: the first step is the first 32 tokens of prompt p0 on both sides (the CPU's prompts
    # are longer, prompt + the GPU's tokens), so calculated scales come from the same rows.
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=calculate, max_num_batched_tokens=32)
    gpu_engine = engine(model, "cuda", dtype="float16", **fp8)
    assert gpu_engine.runner.kv_cache.dtype == np.uint8
    gpu = run_to_completion(gpu_engine, {k: (p, gen) for k, p in requests.items()})
    assert gpu_engine.runner.decode_graphs is not None and gpu_engine.runner.decode_graphs.num_replays > 0
    scales = [layer.kv_scales for layer in gpu_engine.runner.model.layers]
    assert all(not s.calculate for s in scales) and (all(s.k_scale != 1.0 for s in scales) == calculate)
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    forced = {k: (p + gpu[k].outputs[0].token_ids, score) for k, p in requests.items()}
    cpu_engine = engine(model, "cpu", dtype="float32", **fp8)
    cpu = run_to_completion(cpu_engine, forced)
    if calculate:  # the first prefill chunk set the scales on both sides: the same rows, fp16 vs fp32 values
        cpu_scales = [layer.kv_scales for layer in cpu_engine.runner.model.layers]
        for g, c in zip(scales, cpu_scales):
            assert g.k_scale == pytest.approx(c.k_scale, rel=2e-2) and g.v_scale == pytest.approx(c.v_scale, rel=2e-2)

    margin, least_decisive, max_error = FP8_BOUNDS
    forced_run = teacher_forced(requests, gpu, cpu, margin)
    print(f"\n{name} fp8 calculate={calculate}: {forced_run.summary()}")
    forced_run.check(least_decisive, max_error)


@pytest.mark.parametrize("calculate", [False, True], ids=["scales-1", "calculated-scales"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp8_greedy_tokens_equal_the_16_bit_engines_up_to_near_ties(name, calculate):
    model = random_model(FAMILIES[name])
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, model.config.vocab_size, int(n)).tolist(), params)
                for i, n in enumerate(rng.integers(8, 60, 6))}
    want_all = run_to_completion(engine(model, "cuda", dtype="float16"), requests)
    got_all = run_to_completion(engine(model, "cuda", dtype="float16", kv_cache_dtype="fp8",
                                       calculate_kv_scales=calculate), requests)
    matched, worst = 0, 0.0
    for key in requests:
        want, got = want_all[key].outputs[0], got_all[key].outputs[0]
        for i, (want_id, got_id) in enumerate(zip(want.token_ids, got.token_ids)):
            if want_id != got_id:  # a near-tie of the 16-bit run itself; after it the contexts differ
                assert want.logprobs[i][want_id] - want.logprobs[i].get(got_id, -np.inf) < 2 * NEAR, key
                break
            worst = max(worst, abs(want.logprobs[i][want_id] - got.logprobs[i][got_id]))
            matched += 1
    print(f"\n{name} calculate={calculate}: {matched} of {16 * len(requests)} tokens equal before any divergence, "
          f"max |logprob difference| {worst:.3f}")
    assert worst < NEAR
    assert matched >= 16 * len(requests) // 2  # not vacuous


def test_fp8_pool_holds_twice_the_16_bit_blocks_and_swaps_bytes():
    model = random_model(SHAPES["smollm2-d64-gqa3"] | dict(num_hidden_layers=2, tie_word_embeddings=False))
    sized = {kv: engine(model, "cuda", dtype="float16", kv_cache_dtype=kv, num_kv_blocks=None,
                        kv_cache_memory=8 << 20) for kv in ("auto", "fp8")}  # below the max_num_seqs cap
    assert sized["fp8"].runner.kv_cache.nbytes <= 8 << 20
    assert sized["fp8"].runner.kv_cache.shape[2] >= 2 * sized["auto"].runner.kv_cache.shape[2]
    del sized
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, model.config.vocab_size, int(n)).tolist(), params)
                for i, n in enumerate(rng.integers(8, 40, 8))}
    ample = run_to_completion(engine(model, "cuda", dtype="float16", kv_cache_dtype="fp8"), requests)
    tight_engine = engine(model, "cuda", dtype="float16", kv_cache_dtype="fp8", num_kv_blocks=12,
                          preemption_mode="swap")
    tight = run_to_completion(tight_engine, requests)
    assert tight_engine.stats.num_preemptions_swap > 0
    identical = 0
    for key in requests:  # batch shapes differ, so fp16 may flip a genuine near-tie, never a decisive choice
        want, got = ample[key].outputs[0], tight[key].outputs[0]
        first = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if first is None:
            identical += 1
        else:
            assert top2(want.logprobs[first])[1] < 0.05, f"{key} diverges at output {first}"
    assert identical >= 6


def test_checkpoint_kv_scales_reach_the_gpu_kernels():
    """k_scale / v_scale tensors in the checkpoint (vLLM's names) seed each layer's [2] device scale buffer, which
    the kernels and the decode graphs read: the buffers hold them after the run (nothing recalculated), the
    logprobs move away from the scales-1 run's, and the greedy tokens equal the CPU FP8 engine's with the same
    checkpoint scales up to near-ties."""
    import dataclasses

    model = random_model(FAMILIES["llama"])
    k_scales = [0.05 + 0.01 * i for i in range(model.config.num_hidden_layers)]
    v_scales = [0.03 + 0.005 * i for i in range(model.config.num_hidden_layers)]
    tensors = {}
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k, dtype=np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(v, dtype=np.float32)
    scaled = dataclasses.replace(model, weights=dict(model.weights) | tensors)
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, model.config.vocab_size, int(n)).tolist(), params)
                for i, n in enumerate(rng.integers(8, 60, 6))}
    gpu_engine = engine(scaled, "cuda", dtype="float16", kv_cache_dtype="fp8")
    got_all = run_to_completion(gpu_engine, requests)
    assert gpu_engine.runner.decode_graphs is not None and gpu_engine.runner.decode_graphs.num_replays > 0
    ops = gpu_engine.runner.model.ops
    for layer, k, v in zip(gpu_engine.runner.model.layers, k_scales, v_scales):
        assert ops.kv_scale_buffer(layer.kv_scales).get().tolist() == [np.float32(k), np.float32(v)]
    ones = run_to_completion(engine(model, "cuda", dtype="float16", kv_cache_dtype="fp8"), requests)
    assert any(ones[key].outputs[0].cumulative_logprob != got_all[key].outputs[0].cumulative_logprob
               for key in requests)
    want_all = run_to_completion(engine(scaled, "cpu", dtype="float32", kv_cache_dtype="fp8"), requests)
    matched = 0
    for key in requests:
        want, got = want_all[key].outputs[0], got_all[key].outputs[0]
        for i, (want_id, got_id) in enumerate(zip(want.token_ids, got.token_ids)):
            if want_id != got_id:  # a near-tie of the CPU run itself; after it the contexts differ
                assert want.logprobs[i][want_id] - want.logprobs[i].get(got_id, -np.inf) < 2 * NEAR, key
                break
            matched += 1
    print(f"\ncheckpoint scales: {matched} of {16 * len(requests)} tokens equal the CPU FP8 engine's")
    assert matched >= 16 * len(requests) // 2  # not vacuous
