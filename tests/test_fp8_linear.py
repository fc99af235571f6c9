"""FP8 weights on the CPU (ops/fp8_linear.py, quantization="fp8"): the NumPy reference a GPU FP8 GEMM must match.

What is checked: per-output-channel weight scales (max |column| / 448) and e4m3 values; per-token activation
scales; `x @ Fp8Linear` equals the explicit product (its sums rounded to bfloat16, or not) and stays within
e4m3's rounding of the exact one; zero columns / rows quantize to zeros without NaN; the model quantizes the
layers' linears only;
LLM(quantization="fp8") runs end to end, its logits stay close to fp32's and its greedy tokens equal fp32's
up to near-ties; bad values, CUDA and tensor parallelism are refused by name; the bench counts 1-byte
linear weights.
"""
from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest
from fixtures_tiny_model import write_tiny_model
from test_kv_cache_fp8 import _smooth_model
from tiny_engine import run_to_completion, tiny_engine, tiny_model

from offline_paged import LLM
from offline_paged.benchmark.bench import RooflineModel
from offline_paged.core.config import QUANTIZATIONS as CONFIG_QUANTIZATIONS
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops import fp8_linear
from offline_paged.ops.fp8_linear import QUANTIZATIONS, Fp8Linear, quantize_rows
from offline_paged.ops.kv_scales import FP8_E4M3
from offline_paged.ops.ops_numpy import NumpyOps

E4M3_UNIT = 2.0 ** -4  # round-to-nearest relative error of e4m3 (3 mantissa bits)


def test_weight_scales_are_per_output_channel_and_values_are_e4m3():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 20)) * np.logspace(-3, 2, 20)  # [in, out], columns over 5 decades
    layer = Fp8Linear.quantize(w)
    assert layer.weight.dtype == FP8_E4M3 and layer.weight.shape == (48, 20)
    np.testing.assert_allclose(layer.weight_scale, np.abs(w).max(axis=0) / 448, rtol=1e-6)
    assert np.abs(layer.weight.astype(np.float32)).max(axis=0) == pytest.approx(448.0)  # each column's max
    error = np.abs(layer.dequantized(np.float64) - w)  # [in, out]
    assert (error <= E4M3_UNIT * np.abs(w).max(axis=0)).all()  # within e4m3's rounding of each column's range


def test_activation_scales_are_per_token():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 32)) * np.array([1e-3, 1, 10, 1e3, 0])[:, None]
    xq, x_scale = quantize_rows(x)
    np.testing.assert_allclose(x_scale[:4], np.abs(x[:4]).max(axis=1) / 448, rtol=1e-6)
    assert x_scale[4] == 1.0 and not xq[4].astype(np.float32).any()  # a zero row: scale 1, zeros
    assert np.isfinite(xq.astype(np.float32)).all()


def explicit_product(xq, x_scale, layer: Fp8Linear, bf16_products: bool):
    """The module docstring's product, spelled out in float64: the e4m3 values' sums, rounded to bfloat16 when
    `bf16_products`, times x_scale per row and weight_scale per column."""
    sums = xq.astype(np.float64) @ layer.weight.astype(np.float64)  # [T, out]
    if bf16_products:
        sums = sums.astype(ml_dtypes.bfloat16).astype(np.float64)
    return sums * np.asarray(x_scale, np.float64)[:, None] * layer.weight_scale.astype(np.float64)[None, :]


@pytest.mark.parametrize("bf16_products", [True, False])
def test_product_equals_the_dequantized_reference_and_stays_near_the_exact_one(bf16_products, monkeypatch):
    monkeypatch.setattr(fp8_linear, "BF16_PRODUCTS", bf16_products)
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((64, 24)), rng.standard_normal((7, 64))
    w[:, 3] = 0.0  # an all-zero output channel
    layer = Fp8Linear.quantize(w)
    got = x @ layer  # NumPy defers to Fp8Linear.__rmatmul__
    xq, x_scale = quantize_rows(x)
    np.testing.assert_allclose(got, explicit_product(xq, x_scale, layer, bf16_products), rtol=1e-6, atol=1e-9)
    unrounded = (xq.astype(np.float64) * x_scale[:, None]) @ layer.dequantized(np.float64)
    # bfloat16's rounding of the sums, and nothing more, is what sets the two forms apart.
    np.testing.assert_allclose(got, unrounded, rtol=2.0 ** -8 if bf16_products else 1e-6, atol=1e-9)
    assert bf16_products == (not np.allclose(got, unrounded, rtol=1e-6, atol=1e-9))
    assert got.dtype == x.dtype and not got[:, 3].any()
    exact = x @ w
    # Each product term carries two e4m3 roundings; random signs make the sum's error far smaller.
    assert np.abs(got - exact).max() < 2 * E4M3_UNIT * np.abs(x).max() * np.abs(w).sum(axis=0).max()
    assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()


def test_a_mismatched_product_is_refused():
    layer = Fp8Linear.quantize(np.ones((8, 4)))
    with pytest.raises(ValueError, match="cannot multiply"):
        np.ones((3, 5)) @ layer
    with pytest.raises(ValueError, match="2-D"):
        Fp8Linear.quantize(np.ones(8))


def test_the_model_quantizes_the_layer_linears_only():
    model = tiny_model()
    fp8 = Llama(model.config, model.weights, NumpyOps(), quantization="fp8")
    for layer in fp8.layers:
        assert all(isinstance(getattr(layer, name), Fp8Linear) for name in ("qkv", "o_proj", "gate_up", "down"))
    assert isinstance(fp8.embed, np.ndarray) and isinstance(fp8.lm_head, np.ndarray)


@pytest.mark.parametrize("seed", range(2))
def test_fp8_logits_stay_close_to_fp32_teacher_forced(seed):
    """Every position's logits (prefill chunks and decode rows) against fp32's. Each FP8 product is off by
    ~3.5% rms (two e4m3 roundings per term); this 32-wide random model has eight of them per position and no
    trained model's redundancy, so its logits move by ~9% rms, at most ~15% of their range (measured). Bounds:
    within 0.25 of the range, and the argmax equal wherever fp32's top-2 gap exceeds 0.1 of it (16 positions
    of 97 here)."""
    model = _smooth_model(seed)
    fp8 = Llama(model.config, model.weights, NumpyOps(), quantization="fp8")
    fp32 = Llama(model.config, model.weights, NumpyOps())
    rng = np.random.default_rng(seed)
    batch = [(i, rng.integers(4, 260, int(n)).tolist()) for i, n in enumerate(rng.integers(5, 40, 4))]
    got = np.concatenate(SimpleRunner(fp8, 64, 4).step(batch, all_logits=True))  # [T, V]
    want = np.concatenate(SimpleRunner(fp32, 64, 4).step(batch, all_logits=True))  # [T, V]
    assert not np.array_equal(got, want)  # the weights really are FP8
    spread = want.max(axis=1) - want.min(axis=1)  # [T]
    error = np.abs(got - want).max(axis=1)  # [T]
    top2 = np.sort(want, axis=1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > 0.1 * spread
    print(f"\nmax |logit err| / range {float((error / spread).max()):.4f}, {decisive.sum()} decisive of {len(want)}")
    assert (error < 0.25 * spread).all()
    assert decisive.sum() >= 8
    assert (got.argmax(axis=1) == want.argmax(axis=1))[decisive].all()


def test_llm_with_fp8_weights_runs_and_greedy_tokens_equal_fp32_up_to_near_ties(tmp_path):
    model_dir = str(write_tiny_model(tmp_path / "tiny"))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 30 + 9 * i))} for i in range(8)]
    outputs = {q: LLM(model_dir, device="cpu", quantization=q).generate(prompts, params, use_tqdm=False)
               for q in (None, "fp8")}
    matched = 0
    for want_request, got_request in zip(outputs[None], outputs["fp8"]):
        want, got = want_request.outputs[0], got_request.outputs[0]
        assert len(got.token_ids) == 8
        for i, (want_id, got_id) in enumerate(zip(want.token_ids, got.token_ids)):
            if want_id != got_id:  # fp32 itself ranks the FP8 token close to its own
                ranked = want.logprobs[i]  # {token: Logprob}: fp32's top 5
                assert got_id in ranked and ranked[want_id].logprob - ranked[got_id].logprob < 0.5
                break
            matched += 1
    print(f"\n{matched} of 64 tokens equal before any divergence")
    assert matched >= 8  # not vacuous (measured: 14; this random model is sharp, divergences come early)


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "int8"}, "quantization='int8' is not supported: use None or one of"),
    ({"quantization": "fp8", "tensor_parallel_size": 2}, "not supported with tensor_parallel_size"),
])
def test_bad_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
    assert CONFIG_QUANTIZATIONS == QUANTIZATIONS  # the pure-Python core keeps its own copy


def test_fp8_weights_on_cuda_switched_off_are_refused_and_tensor_parallelism_always(monkeypatch):
    """With models.llama.FP8_WEIGHTS_ON_CUDA off, an ops object whose array module is not NumPy (CudaOps') is
    refused before any weight is touched; a tensor-parallel shard is refused whatever the switch says."""
    import offline_paged.models.llama as llama_module

    class _NotNumpyOps(NumpyOps):
        xp = types.SimpleNamespace()

    model = tiny_model()
    monkeypatch.setattr(llama_module, "FP8_WEIGHTS_ON_CUDA", False)
    with pytest.raises(ValueError, match=r"or on CUDA \(use device='cpu'\)"):
        Llama(model.config, model.weights, _NotNumpyOps(), quantization="fp8")
    monkeypatch.setattr(llama_module, "FP8_WEIGHTS_ON_CUDA", True)
    with pytest.raises(ValueError, match="not supported with tensor parallelism yet"):
        Llama(model.config, model.weights, NumpyOps(), quantization="fp8", tp=types.SimpleNamespace())


def test_numpy_ops_builds_the_reference_fp8_linear():
    """NumpyOps.quantize_linear takes [out, in] (the checkpoint's layout, what CudaOps keeps) and gives the same
    layer as Fp8Linear.quantize of [in, out]."""
    w = np.random.default_rng(3).standard_normal((24, 40)).astype(np.float32)  # [out, in]
    built, want = NumpyOps().quantize_linear(w), Fp8Linear.quantize(w.T)
    assert built.shape == (40, 24)
    np.testing.assert_array_equal(built.weight.view(np.uint8), want.weight.view(np.uint8))
    np.testing.assert_array_equal(built.weight_scale, want.weight_scale)


def test_the_engine_runs_fp8_weights_with_an_fp8_kv_cache():
    engine = tiny_engine(dtype="float32", quantization="fp8", kv_cache_dtype="fp8")
    out = run_to_completion(engine, {"a": ([5, 6, 7, 8], SamplingParams(max_tokens=5, ignore_eos=True))})
    assert len(out["a"].outputs[0].token_ids) == 5


def test_roofline_counts_fp8_linear_weights_at_one_byte():
    config = tiny_model().config
    plain, fp8 = RooflineModel(config, itemsize=2), RooflineModel(config, itemsize=2, linear_itemsize=1)
    c = config
    scales = 4 * c.num_hidden_layers * ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                                        + 2 * c.hidden_size + 2 * c.intermediate_size)  # float32 per out channel
    assert fp8.linear_scale_bytes == scales and plain.linear_scale_bytes == 0
    assert plain.weight_bytes - fp8.weight_bytes == plain.linear_params - scales
