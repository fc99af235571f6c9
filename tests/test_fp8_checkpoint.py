"""Pre-quantized FP8 checkpoints (models/quant_config.py, models/checkpoint_scales.py, Fp8Linear.from_quantized)
and checkpoint KV scales, on the CPU.

What is checked: a compressed-tensors per-channel checkpoint holding exactly what quantization="fp8" computes
gives the same logits bit for bit (one forward serves both); a per-tensor checkpoint (vLLM's "fp8", either scale
spelling) maps its values exactly and equals the per-channel form of the same values; static input scales
quantize activations per tensor (a fused linear takes its parts' max, as vLLM); ignore lists keep those linears
16-bit; every FP8 checkpoint stays close to the 16-bit model; every other quantization config, and every
inconsistent FP8 checkpoint, is refused naming the method or the tensor; CUDA and tensor parallelism are refused;
k_scale / v_scale tensors (three spellings) set each layer's KvScales for an FP8 KV cache exactly as a manual
scale would, are ignored by a 16-bit cache, and calculate_kv_scales still recomputes.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
from fixtures_fp8_checkpoint import (add_tensors, calibrated_input_scales, quantization_config, quantize_weight,
                                     write_fp8_checkpoint, write_plain_model)
from test_fp8_linear import explicit_product
from tiny_engine import run_to_completion

from offline_paged.benchmark.bench import random_workload, run_bench
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine
from offline_paged.models.config import LlamaConfig
from offline_paged.models.llama import Llama
from offline_paged.models.loader import load_model
from offline_paged.models.quant_config import Fp8CheckpointConfig
from offline_paged.models.safetensors_io import read_safetensors
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.models.tp_shard import check_divisible
from offline_paged.ops import fp8_linear
from offline_paged.ops.fp8_linear import Fp8Linear, quantize_rows
from offline_paged.ops.kv_scales import FP8_E4M3, KvScales, quantize_fp8
from offline_paged.ops.ops_numpy import NumpyOps

LINEARS = ("qkv", "o_proj", "gate_up", "down")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_plain_model(tmp_path_factory.mktemp("plain"))


def _model(directory, **kwargs) -> Llama:
    loaded = load_model(directory)
    return Llama(loaded.config, loaded.weights, NumpyOps(), **kwargs)


def _logits(model: Llama) -> np.ndarray:
    """Teacher-forced logits [T, V] of eight sequences, prefilled in two chunks (the second reads the cache)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (23, 31, 17, 40, 28, 35, 26, 33)]
    runner = SimpleRunner(model, 64, 4)
    first = runner.step([(i, p[:9]) for i, p in enumerate(prompts)], all_logits=True)
    second = runner.step([(i, p[9:]) for i, p in enumerate(prompts)], all_logits=True)
    return np.concatenate(first + second)  # [T, V]


def _assert_close_to_16_bit(got: np.ndarray, want: np.ndarray) -> None:
    """The bound of tests/test_fp8_linear.py's FP8-weights model: each FP8 product is off by ~3.5% rms, eight of
    them per position on a 32-wide random model move its logits by up to ~15% of their range; so within 0.25 of
    the range, and the same argmax wherever the 16-bit top-2 gap exceeds 0.1 of it."""
    spread = want.max(axis=1) - want.min(axis=1)  # [T]
    error = np.abs(got - want).max(axis=1)  # [T]
    top2 = np.sort(want, axis=1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > 0.1 * spread
    print(f"\nmax |logit err| / range {float((error / spread).max()):.4f}, {decisive.sum()} decisive of {len(want)}")
    assert not np.array_equal(got, want)  # the weights really are FP8
    assert (error < 0.25 * spread).all()
    assert decisive.sum() >= 8
    assert (got.argmax(axis=1) == want.argmax(axis=1))[decisive].all()


# ------------------------------------------------------------------ FP8 weights from the checkpoint
def test_per_channel_checkpoint_equals_quantization_fp8_bit_for_bit(plain, tmp_path):
    fp8_dir = write_fp8_checkpoint(plain, tmp_path / "ct", "compressed-tensors", "channel")
    loaded = _model(fp8_dir)
    quantized_at_load = _model(plain, quantization="fp8")
    assert loaded.quantization == "fp8"
    for got, want in zip(loaded.layers, quantized_at_load.layers):
        for name in LINEARS:
            layer = getattr(got, name)
            assert isinstance(layer, Fp8Linear) and layer.input_scale is None
            assert layer.weight.tobytes() == getattr(want, name).weight.tobytes()
            np.testing.assert_array_equal(layer.weight_scale, getattr(want, name).weight_scale)
    got, want = _logits(loaded), _logits(quantized_at_load)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(_logits(_model(fp8_dir, quantization="fp8")), got)  # the checkpoint decides
    _assert_close_to_16_bit(got, _logits(_model(plain)))


def test_f8_e4m3_tensors_read_as_torch_writes_them(tmp_path):
    """An independent writer: torch's float8_e4m3fn through safetensors.torch, read by our reader."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save

    values = torch.tensor([0.0, -0.0, 1.5, -448.0, 0.013671875, 2.0 ** -9, 240.0, -3.25])
    torch_save({"w": values.to(torch.float8_e4m3fn).reshape(2, 4)}, str(tmp_path / "t.safetensors"))
    read = read_safetensors(tmp_path / "t.safetensors")["w"]
    assert read.dtype == FP8_E4M3 and read.shape == (2, 4)
    np.testing.assert_array_equal(read.astype(np.float32).reshape(-1), values.numpy())


@pytest.mark.parametrize("scale_name", ["weight_scale", "weight_scale_inv"])
def test_per_tensor_fp8_checkpoint_keeps_its_values_and_equals_their_per_channel_form(plain, tmp_path, scale_name):
    fp8_dir = write_fp8_checkpoint(plain, tmp_path / "fp8", "fp8", "tensor", scale_name=scale_name)
    model = _model(fp8_dir)
    raw = load_model(plain).weights
    q, k, v = (raw[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    parts = [quantize_weight(np.asarray(w), "tensor") for w in (q, k, v)]
    want = np.concatenate([wq.astype(np.float32) * s for wq, s in parts]).T  # [E, (H + 2 Hkv) D]
    np.testing.assert_array_equal(model.layers[1].qkv.dequantized(), want)  # each part keeps its own scale
    assert len(set(model.layers[1].qkv.weight_scale.tolist())) == 3
    # The same e4m3 values with each tensor's scale repeated per channel: compressed-tensors' channel layout.
    tensors = {}
    for module in [n[:-len(".weight")] for n in load_model(fp8_dir).weights if n.endswith("proj.weight")]:
        scale = np.asarray(load_model(fp8_dir).weights[f"{module}.{scale_name}"])
        out = raw[f"{module}.weight"].shape[0]
        tensors[f"{module}.weight_scale"] = np.full((out, 1), scale, dtype=np.float32)
    channel_dir = write_fp8_checkpoint(plain, tmp_path / "ct", "compressed-tensors", "tensor")
    add_tensors(channel_dir, tensors)
    got = _logits(model)
    np.testing.assert_array_equal(got, _logits(_model(channel_dir)))
    _assert_close_to_16_bit(got, _logits(_model(plain)))


def test_static_input_scales_quantize_activations_per_tensor(plain, tmp_path):
    fp8_dir = write_fp8_checkpoint(plain, tmp_path / "static", "compressed-tensors", "channel", static=True)
    scales = calibrated_input_scales(plain)
    k_proj = "model.layers.0.self_attn.k_proj"
    add_tensors(fp8_dir, {f"{k_proj}.input_scale": np.array([2 * scales[k_proj]], dtype=np.float32)})
    model = _model(fp8_dir)
    assert model.layers[0].qkv.input_scale == pytest.approx(2 * scales[k_proj])  # the parts' max, as vLLM
    assert model.layers[1].down.input_scale == pytest.approx(scales["model.layers.1.mlp.down_proj"])
    dynamic = _model(write_fp8_checkpoint(plain, tmp_path / "dynamic", "compressed-tensors", "channel"))
    got = _logits(model)
    assert not np.array_equal(got, _logits(dynamic))
    _assert_close_to_16_bit(got, _logits(_model(plain)))


def test_static_product_equals_the_explicit_per_tensor_reference():
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((40, 16)), rng.standard_normal((6, 40)) * 3
    parts = [quantize_weight(w[:, :10].T.copy(), "tensor"), quantize_weight(w[:, 10:].T.copy(), "channel")]
    layer = Fp8Linear.from_quantized([p[0] for p in parts], [p[1] for p in parts], input_scales=[0.01, 0.02])
    xq = np.clip(x / 0.02, -448, 448).astype(FP8_E4M3)  # saturates past |8.96|
    np.testing.assert_allclose(x @ layer, explicit_product(xq, np.full(6, 0.02), layer, fp8_linear.BF16_PRODUCTS),
                               rtol=1e-6, atol=1e-9)
    dynamic = Fp8Linear.from_quantized([p[0] for p in parts], [p[1] for p in parts])
    xq, x_scale = quantize_rows(x)
    np.testing.assert_allclose(x @ dynamic, explicit_product(xq, x_scale, dynamic, fp8_linear.BF16_PRODUCTS),
                               rtol=1e-6, atol=1e-9)


def test_from_quantized_refuses_bad_parts():
    wq = quantize_fp8(np.ones((4, 8)), 1.0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Linear.from_quantized([np.ones((4, 8), np.float32)], [np.float32(1)])
    with pytest.raises(ValueError, match="one per tensor or per output channel"):
        Fp8Linear.from_quantized([wq], [np.ones(3, np.float32)])
    with pytest.raises(ValueError, match="finite"):
        Fp8Linear.from_quantized([wq], [np.float32(np.nan)])


def test_ignored_modules_stay_16_bit(plain, tmp_path):
    ignore = ["lm_head", "model.layers.0.mlp.down_proj", r"re:model\.layers\.1\.self_attn\.[qkv]_proj"]
    model = _model(write_fp8_checkpoint(plain, tmp_path / "ct", ignore=ignore))
    kept = {(0, "down"), (1, "qkv")}
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            assert isinstance(getattr(layer, name), Fp8Linear) == ((i, name) not in kept), (i, name)
    assert isinstance(_model(tmp_path / "ct", quantization="fp8").layers[0].down, np.ndarray)  # the checkpoint decides
    # The reference: quantization="fp8" everywhere, those two linears put back in 16 bits.
    reference, plain_model = _model(plain, quantization="fp8"), _model(plain)
    for i, name in kept:
        setattr(reference.layers[i], name, getattr(plain_model.layers[i], name))
    np.testing.assert_array_equal(_logits(model), _logits(reference))


def test_the_engine_runs_an_fp8_checkpoint_as_quantization_fp8(plain, tmp_path):
    fp8_dir = write_fp8_checkpoint(plain, tmp_path / "ct")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    requests = {str(i): (list(range(10 + 5 * i, 30 + 7 * i)), params) for i in range(4)}
    runs = []
    for model, quantization in ((fp8_dir, None), (plain, "fp8")):
        engine = LLMEngine(EngineConfig(model=str(model), device="cpu", block_size=4, num_kv_blocks=128,
                                        quantization=quantization, kv_cache_dtype="fp8"))
        runs.append({rid: out.outputs[0] for rid, out in run_to_completion(engine, dict(requests)).items()})
    for rid in requests:
        assert runs[0][rid].token_ids == runs[1][rid].token_ids and len(runs[0][rid].token_ids) == 6
        assert runs[0][rid].cumulative_logprob == runs[1][rid].cumulative_logprob


# ------------------------------------------------------------------ refusals
_CT = quantization_config("compressed-tensors")
_GROUP = _CT["config_groups"]["group_0"]


def _ct(**group_changes) -> dict:
    return _CT | {"config_groups": {"group_0": _GROUP | group_changes}}


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quant_method 'gptq'\) is not supported"),
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq'\) is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method 'bitsandbytes'\) is not supported"),
    ({"quant_method": "mxfp4"}, r"quant_method 'mxfp4'\) is not supported"),
    ({"bits": 4}, r"quant_method None\) is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"'fp8'\): block-wise scales \(weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "tensorwise"}, r"'fp8'\): activation_scheme 'tensorwise'"),
    (_CT | {"format": "int-quantized"}, r"'compressed-tensors'\): format 'int-quantized'"),
    (_CT | {"format": "pack-quantized"}, r"'compressed-tensors'\): format 'pack-quantized'"),
    (_ct(weights=_GROUP["weights"] | {"type": "int"}), r"'compressed-tensors'\) group 'group_0': weights type 'int'"),
    (_ct(weights=_GROUP["weights"] | {"num_bits": 4}), r"weights type 'float' num_bits 4 is not supported"),
    (_ct(weights=_GROUP["weights"] | {"strategy": "group", "group_size": 128}), r"weights strategy 'group'"),
    (_ct(weights=_GROUP["weights"] | {"strategy": "block"}), r"weights strategy 'block'"),
    (_ct(input_activations=None), r"weight-only FP8 \(input_activations null, W8A16\) is not supported"),
    (_ct(input_activations=_GROUP["input_activations"] | {"strategy": "tensor"}),
     r"input_activations strategy 'tensor' with dynamic True"),
    (_ct(input_activations=_GROUP["input_activations"] | {"type": "int"}), r"input_activations type 'int'"),
    (_ct(targets=["re:.*mlp.*"]), r"targets \['re:\.\*mlp\.\*'\] are not supported"),
    (_ct(output_activations=_GROUP["input_activations"]), r"output_activations quantization is not supported"),
    (_CT | {"kv_cache_scheme": {"type": "int", "num_bits": 8, "strategy": "tensor"}}, r"kv_cache_scheme type 'int'"),
    (_CT | {"config_groups": {"a": _GROUP, "b": _GROUP}}, r"exactly one config group is supported"),
    (_CT | {"sparsity_config": {"format": "sparse-24"}}, r"sparsity_config \(sparse weights\) is not supported"),
    (_CT | {"ignore": "lm_head"}, r"ignore must be a list of module names"),
    (_CT | {"ignore": ["re:("]}, r"ignore entry 're:\(' is not a valid regular expression"),
])
def test_every_other_quantization_config_is_refused_by_name(plain, qconfig, message):
    raw = json.loads((plain / "config.json").read_text()) | {"quantization_config": qconfig}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_dict(raw)


def test_the_config_round_trips_with_its_quantization(plain):
    for qconfig in (quantization_config("fp8", static=True, ignore=("lm_head", "re:x")), _CT):
        config = LlamaConfig.from_dict(json.loads((plain / "config.json").read_text()) | {"quantization_config": qconfig})
        assert isinstance(config.quantization, Fp8CheckpointConfig)
        assert LlamaConfig.from_dict(config.to_dict()) == config


def _rewrite_config(directory, **changes):
    raw = json.loads((directory / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize("case, message", [
    ("f8_without_config", r"unexpected tensors \['model\.layers\.0\.mlp\.down_proj\.weight_scale', .*FP8 scales, "
                          r"but config\.json has no quantization_config"),
    ("f8_weight_in_16_bit_model", r"tensor model\.layers\.0\.mlp\.down_proj\.weight has dtype F8_E4M3, but "
                                  r"config\.json has no quantization_config"),
    ("float_weight", r"tensor model\.layers\.0\.mlp\.down_proj\.weight has dtype F32, but the checkpoint's "
                     r"quantization_config quantizes it"),
    ("quantized_lm_head", r"tensor lm_head\.weight has dtype F8_E4M3, but config\.json's quantization_config does "
                          r"not quantize it"),
    ("missing_scale", r"missing tensors \['model\.layers\.0\.mlp\.down_proj\.weight_scale'\]"),
    ("both_spellings", r"unexpected tensors \['model\.layers\.0\.mlp\.down_proj\.weight_scale'\]"),
    ("bad_scale_shape", r"scale tensor model\.layers\.0\.mlp\.down_proj\.weight_scale has shape \(3,\)"),
    ("missing_input_scale", r"missing tensors \['model\.layers\.0\.mlp\.down_proj\.input_scale'\]"),
    ("dynamic_with_input_scale", r"unexpected tensors \['model\.layers\.0\.mlp\.down_proj\.input_scale'\]"),
    ("partly_ignored", r"ignores only some of \['model\.layers\.0\.self_attn\.q_proj'"),
    ("bad_kv_scale", r"scale tensor model\.layers\.1\.self_attn\.k_scale has shape \(2,\)"),
])
def test_an_inconsistent_fp8_checkpoint_is_refused_naming_the_tensor(plain, tmp_path, case, message):
    down = "model.layers.0.mlp.down_proj"
    directory = write_fp8_checkpoint(plain, tmp_path / "ct", static=case == "missing_input_scale")
    f8 = quantize_fp8(np.ones((32, 64), np.float32), 1.0)
    if case == "f8_without_config":
        _rewrite_config(directory, quantization_config=None)
    elif case == "f8_weight_in_16_bit_model":
        directory = add_tensors(write_plain_model(tmp_path / "plain"), {f"{down}.weight": f8})
    elif case == "float_weight":
        add_tensors(directory, {f"{down}.weight": np.ones((32, 64), np.float32)})
    elif case == "quantized_lm_head":
        add_tensors(directory, {"lm_head.weight": quantize_fp8(np.ones((259, 32), np.float32), 1.0)})
    elif case == "missing_scale":
        add_tensors(directory, {}, drop=(f"{down}.weight_scale",))
    elif case == "both_spellings":
        add_tensors(directory, {f"{down}.weight_scale_inv": np.ones((32, 1), np.float32)})
    elif case == "bad_scale_shape":
        add_tensors(directory, {f"{down}.weight_scale": np.ones(3, np.float32), f"{down}.weight": f8})
    elif case == "missing_input_scale":
        add_tensors(directory, {}, drop=(f"{down}.input_scale",))
    elif case == "dynamic_with_input_scale":
        add_tensors(directory, {f"{down}.input_scale": np.ones(1, np.float32)})
    elif case == "partly_ignored":
        _rewrite_config(directory, quantization_config=quantization_config(
            "compressed-tensors", ignore=("lm_head", "model.layers.0.self_attn.q_proj")))
    elif case == "bad_kv_scale":
        add_tensors(directory, {"model.layers.1.self_attn.k_scale": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match=message):
        load_model(directory)


def test_cuda_and_tensor_parallelism_refuse_an_fp8_checkpoint(plain, tmp_path, monkeypatch):
    """Refused before any weight is touched: an ops object whose array module is not NumPy (CudaOps') while
    models.llama.FP8_WEIGHTS_ON_CUDA is off, a tensor-parallel shard or split (checked before any rank starts),
    and the loader's device path (the engine loads host views and the model uploads them)."""
    import offline_paged.models.llama as llama_module

    class _NotNumpyOps(NumpyOps):
        xp = types.SimpleNamespace()

    directory = write_fp8_checkpoint(plain, tmp_path / "ct")
    loaded = load_model(directory)
    monkeypatch.setattr(llama_module, "FP8_WEIGHTS_ON_CUDA", False)
    with pytest.raises(ValueError, match=r"quant_method 'compressed-tensors'\) are not supported .*or on CUDA"):
        Llama(loaded.config, loaded.weights, _NotNumpyOps())
    monkeypatch.setattr(llama_module, "FP8_WEIGHTS_ON_CUDA", True)
    with pytest.raises(ValueError, match=r"quant_method 'compressed-tensors'\) are not supported with tensor par"):
        Llama(loaded.config, loaded.weights, NumpyOps(), tp=types.SimpleNamespace())
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        check_divisible(loaded.config, 2)
    with pytest.raises(ValueError, match=r"load as host views only \(device='cpu'"):
        load_model(directory, xp=np, dtype=np.float32)


# ------------------------------------------------------------------ checkpoint KV scales
K_SCALES, V_SCALES = (0.03, 0.05), (0.02, 0.04)


def _with_kv_scales(plain, directory, spelling: str):
    import shutil

    shutil.copytree(plain, directory)
    tensors = {}
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        if spelling == "vllm":
            tensors |= {p + "k_scale": np.array(K_SCALES[i], np.float32), p + "v_scale": np.array(V_SCALES[i], np.float32)}
        elif spelling == "compressed-tensors":
            tensors |= {p + "k_proj.output_scale": np.array([K_SCALES[i]], np.float32),
                        p + "v_proj.output_scale": np.array([V_SCALES[i]], np.float32)}
        else:  # the older single kv_scale: both
            tensors |= {p + "kv_scale": np.array(K_SCALES[i], np.float32)}
    return add_tensors(directory, tensors)


@pytest.mark.parametrize("spelling", ["vllm", "compressed-tensors", "kv_scale"])
def test_checkpoint_kv_scales_act_as_manual_scales(plain, tmp_path, spelling):
    directory = _with_kv_scales(plain, tmp_path / "kv", spelling)
    model = _model(directory, kv_cache_dtype=FP8_E4M3)
    v_scales = K_SCALES if spelling == "kv_scale" else V_SCALES
    for i, layer in enumerate(model.layers):
        assert (layer.kv_scales.k_scale, layer.kv_scales.v_scale) == pytest.approx((K_SCALES[i], v_scales[i]))
    manual = _model(plain, kv_cache_dtype=FP8_E4M3)
    default = _logits(manual)
    for i, layer in enumerate(manual.layers):
        layer.kv_scales = KvScales(K_SCALES[i], v_scales[i])
    got = _logits(model)
    np.testing.assert_array_equal(got, _logits(manual))
    assert not np.array_equal(got, default)  # the scales change the stored bytes, so the logits
    # A 16-bit KV cache ignores them.
    np.testing.assert_array_equal(_logits(_model(directory)), _logits(_model(plain)))


def test_calculate_kv_scales_still_recomputes_over_checkpoint_scales(plain, tmp_path):
    directory = _with_kv_scales(plain, tmp_path / "kv", "vllm")
    calculated = _model(directory, kv_cache_dtype=FP8_E4M3, calculate_kv_scales=True)
    from_default = _model(plain, kv_cache_dtype=FP8_E4M3, calculate_kv_scales=True)
    np.testing.assert_array_equal(_logits(calculated), _logits(from_default))
    for got, want in zip(calculated.layers, from_default.layers):
        assert (got.kv_scales.k_scale, got.kv_scales.v_scale) == (want.kv_scales.k_scale, want.kv_scales.v_scale)
        assert got.kv_scales.k_scale not in K_SCALES


def test_the_fp8_kv_engine_uses_checkpoint_scales(plain, tmp_path):
    """Engine level: the checkpoint's scales give the tokens and logprobs of the plain model with the same scales
    set by hand, and not those of the default 1.0."""
    directory = _with_kv_scales(plain, tmp_path / "kv", "vllm")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    requests = {str(i): (list(range(10 + 5 * i, 40 + 7 * i)), params) for i in range(3)}
    runs = []
    for model, manual in ((directory, False), (plain, True), (plain, False)):
        engine = LLMEngine(EngineConfig(model=str(model), device="cpu", block_size=4, num_kv_blocks=128,
                                        kv_cache_dtype="fp8"))
        if manual:
            for i, layer in enumerate(engine.executor.model.layers):
                layer.kv_scales = KvScales(K_SCALES[i], V_SCALES[i])
        runs.append({rid: out.outputs[0].cumulative_logprob for rid, out in
                     run_to_completion(engine, dict(requests)).items()})
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_the_bench_records_a_pre_quantized_checkpoint_as_fp8(plain, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(write_fp8_checkpoint(plain, tmp_path / "ct")), device="cpu",
                                    block_size=4, num_kv_blocks=64))
    result = run_bench(engine, random_workload(3, (4, 8), (2, 3), vocab_size=256, seed=0))
    assert engine.config.quantization is None and result.quantization == "fp8"


@pytest.mark.parametrize("value", [0.0, -0.5, np.inf])
def test_a_non_positive_or_infinite_scale_tensor_is_refused(plain, tmp_path, value):
    directory = _with_kv_scales(plain, tmp_path / "kv", "vllm")
    add_tensors(directory, {"model.layers.1.self_attn.v_scale": np.array(value, np.float32)})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.self_attn\.v_scale must hold one positive finite"):
        _model(directory, kv_cache_dtype=FP8_E4M3)
    static = write_fp8_checkpoint(plain, tmp_path / "static", static=True)
    add_tensors(static, {"model.layers.0.mlp.up_proj.input_scale": np.array([value], np.float32)})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.input_scale must hold one positive"):
        _model(static)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_transformers_dequantizes_the_checkpoint_to_our_weights(plain, tmp_path, strategy):
    """Ground truth for the scale semantics (e4m3 value x weight_scale_inv, per tensor or per output channel):
    transformers' fine-grained FP8 loader, which on a machine without a GPU dequantizes to float32 at load."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    directory = write_fp8_checkpoint(plain, tmp_path / "fp8", "fp8", strategy, scale_name="weight_scale_inv")
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model = _model(directory)
    for layer, theirs in zip(model.layers, reference.model.layers):
        attn, mlp = theirs.self_attn, theirs.mlp
        for ours, parts in ((layer.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)), (layer.o_proj, (attn.o_proj,)),
                            (layer.gate_up, (mlp.gate_proj, mlp.up_proj)), (layer.down, (mlp.down_proj,))):
            want = torch.cat([p.weight.detach() for p in parts]).T.numpy()  # [in, out]
            np.testing.assert_array_equal(ours.dequantized(np.float32), want)
