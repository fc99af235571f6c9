"""The engine with FP8 weights (quantization="fp8": e4m3 linears through cuBLASLt's FP8 GEMM) on CUDA, on random-weight
models of the Llama and Qwen3 families, CUDA graphs on. Needs a GPU.

- Teacher-forced against the CPU engine with quantization="fp8" (fp32 activations, NumPy's Fp8Linear): the GPU's
  greedy tokens and prompts are scored by the CPU engine; at every position both report the logprob of the token
  that follows, and their top-1 agrees wherever the CPU's top-2 gap is decisive. With the FP8 KV cache as well.
  The bounds are the FP8 KV cache's test's, widened for the weights: the GPU quantizes 16-bit-rounded weights and
  activations where the CPU quantizes fp32 ones, so an e4m3 rounding may land one step apart.
- Decode steps replayed from CUDA graphs (the graphs' own tuned GEMM) against the same engine run eagerly: the
  greedy tokens are equal up to near-ties and the chosen tokens' logprobs agree closely.
- The layers really are FP8 on the device (uint8 weights, float32 scales), the embedding and LM head stay 16-bit.
- Pre-quantized checkpoints (compressed-tensors per channel with an ignored linear; vLLM fp8 per tensor with static
  input scales) on CUDA: the device holds the checkpoint's own e4m3 bytes and scales, the ignored linear stays
  16-bit, and the greedy tokens equal the CPU engine's on the same checkpoint up to near-ties.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from fixtures_fp8_checkpoint import WEIGHTS, write_fp8_checkpoint  # noqa: E402
from test_gpu_engine import SHAPES, engine, prompts, random_model, write_tiny_gpu_model  # noqa: E402
from teacher_forcing import teacher_forced  # noqa: E402
from tiny_engine import run_to_completion  # noqa: E402

from offline_paged.core.config import EngineConfig  # noqa: E402
from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.engine import LLMEngine  # noqa: E402
from offline_paged.models.safetensors_io import read_safetensors  # noqa: E402
from offline_paged.ops.cuda_fp8_linear import CudaFp8Linear  # noqa: E402

FAMILIES = {"llama": SHAPES["smollm2-d64-gqa3"] | dict(num_hidden_layers=4, tie_word_embeddings=False),
            "qwen3": SHAPES["qwen3"]}
# Per dtype: (top-2 gap / scale that counts as decisive, least share of decisive positions, largest target-logprob
# error / scale). Not calibrated on the device yet. A CPU emulation of the GPU path (the same quantization of fp16
# activations and weights, NumPy fp16 elsewhere, which rounds more often than the kernels) against the fp32 FP8 engine
# on the llama shape: decisive share 0.47 at 2.5e-2, 99.6% agreement there (96% at 1e-2), error 4.2e-2; qwen3: all
# positions decisive and agreeing, error 1.1e-2. bf16: wider, as the 16-bit test's bounds are.
BOUNDS = {"float16": (2.5e-2, 0.35, 6e-2), "bfloat16": (4e-2, 0.25, 1.2e-1)}
NEAR = 1.0  # logprob units: a divergence between graph and eager runs only where the top-2 gap is below 2 NEAR


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"], ids=["kv16", "kv-fp8"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp8_weights_gpu_engine_matches_the_cpu_fp8_engine_teacher_forced(name, dtype, kv_cache_dtype):
    model = random_model(FAMILIES[name])
    requests = prompts(model.config.vocab_size)
    gen = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    fp8 = dict(quantization="fp8", kv_cache_dtype=kv_cache_dtype)
    gpu_engine = engine(model, "cuda", dtype=dtype, **fp8)
    layer = gpu_engine.runner.model.layers[0]
    assert all(isinstance(w, CudaFp8Linear) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert layer.qkv.weight.dtype == np.uint8 and layer.qkv.weight_scale.dtype == np.float32
    assert gpu_engine.runner.model.lm_head.dtype.name == dtype
    gpu = run_to_completion(gpu_engine, {k: (p, gen) for k, p in requests.items()})
    assert gpu_engine.runner.decode_graphs is not None and gpu_engine.runner.decode_graphs.num_replays > 0
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    forced = {k: (p + gpu[k].outputs[0].token_ids, score) for k, p in requests.items()}
    cpu = run_to_completion(engine(model, "cpu", dtype="float32", **fp8), forced)

    margin, least_decisive, max_error = BOUNDS[dtype]
    forced_run = teacher_forced(requests, gpu, cpu, margin)
    print(f"\n{name} {dtype} fp8 weights, kv {kv_cache_dtype}: {forced_run.summary()}")
    forced_run.check(least_decisive, max_error)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp8_weights_in_decode_graphs_equal_the_eager_engine_up_to_near_ties(name, dtype):
    model = random_model(FAMILIES[name])
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, model.config.vocab_size, int(n)).tolist(), params)
                for i, n in enumerate(rng.integers(8, 60, 6))}
    eager_engine = engine(model, "cuda", dtype=dtype, quantization="fp8", cuda_graphs=False)
    graph_engine = engine(model, "cuda", dtype=dtype, quantization="fp8")
    want_all = run_to_completion(eager_engine, requests)
    got_all = run_to_completion(graph_engine, requests)
    assert eager_engine.runner.decode_graphs is None or eager_engine.runner.decode_graphs.num_replays == 0
    assert graph_engine.runner.decode_graphs.num_replays > 0
    matched, worst = 0, 0.0
    for key in requests:
        want, got = want_all[key].outputs[0], got_all[key].outputs[0]
        for i, (want_id, got_id) in enumerate(zip(want.token_ids, got.token_ids)):
            if want_id != got_id:  # a near-tie of the eager run (the GEMMs' algorithms differ); then contexts differ
                assert want.logprobs[i][want_id] - want.logprobs[i].get(got_id, -np.inf) < 2 * NEAR, key
                break
            worst = max(worst, abs(want.logprobs[i][want_id] - got.logprobs[i][got_id]))
            matched += 1
    print(f"\n{name} {dtype}: {matched} of {16 * len(requests)} tokens equal before any divergence, "
          f"max |logprob difference| {worst:.3f}")
    assert worst < NEAR
    assert matched >= 16 * len(requests) // 2  # not vacuous


@pytest.mark.parametrize("case", ["ct-channel-dynamic", "fp8-tensor-static"])
def test_a_prequantized_checkpoint_runs_on_cuda_with_its_own_e4m3_values(case, tmp_path):
    plain = write_tiny_gpu_model(tmp_path / "plain")
    if case == "ct-channel-dynamic":
        directory = write_fp8_checkpoint(plain, tmp_path / case, ignore=("lm_head", "model.layers.1.mlp.down_proj"))
    else:
        directory = write_fp8_checkpoint(plain, tmp_path / case, method="fp8", strategy="tensor", static=True)
    settings = dict(model=str(directory), block_size=16, num_kv_blocks=128, max_num_seqs=8)
    gpu_engine = LLMEngine(EngineConfig(device="cuda", dtype="float16", **settings))
    stored = read_safetensors(directory / WEIGHTS)
    layer = gpu_engine.runner.model.layers[0]
    parts = [stored[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]  # [out_i, in] e4m3 each
    want = np.concatenate(parts).view(np.uint8)  # [out, in]
    assert isinstance(layer.qkv, CudaFp8Linear)
    np.testing.assert_array_equal(layer.qkv.weight.get()[:want.shape[0], :want.shape[1]], want)
    assert (layer.qkv.input_scale is None) == (case == "ct-channel-dynamic")
    last_down = gpu_engine.runner.model.layers[1].down
    assert isinstance(last_down, CudaFp8Linear) == (case != "ct-channel-dynamic")  # the ignored linear: 16-bit
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, 200, int(n)).tolist(), params) for i, n in enumerate(rng.integers(8, 60, 6))}
    got_all = run_to_completion(gpu_engine, requests)
    assert gpu_engine.runner.decode_graphs is not None and gpu_engine.runner.decode_graphs.num_replays > 0
    want_all = run_to_completion(LLMEngine(EngineConfig(device="cpu", dtype="float32", **settings)), requests)
    matched = 0
    for key in requests:
        want, got = want_all[key].outputs[0], got_all[key].outputs[0]
        for i, (want_id, got_id) in enumerate(zip(want.token_ids, got.token_ids)):
            if want_id != got_id:  # a near-tie of the CPU run itself; after it the contexts differ
                assert want.logprobs[i][want_id] - want.logprobs[i].get(got_id, -np.inf) < 2 * NEAR, key
                break
            assert abs(want.logprobs[i][want_id] - got.logprobs[i][got_id]) < NEAR, key
            matched += 1
    print(f"\n{case}: {matched} of {12 * len(requests)} tokens equal the CPU engine's on the same checkpoint")
    assert matched >= len(requests)  # not vacuous (the H200 matched 15 and 32 of 72: greedy fp16 runs part at near-ties)
