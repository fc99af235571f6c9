"""The whole engine on CUDA (fp16, and bf16 with and without CUDA graphs) against the engine on the CPU
(fp32, the ground truth), on random-weight
Llamas of realistic shape built from the same seed on both sides; preemption on the GPU is transparent;
the CLI job runs on the GPU. Needs a GPU.

Teacher forcing goes through the engine's own outputs: the GPU engine greedily generates with logprobs
and prompt logprobs (top-2); the CPU engine then scores prompt + the GPU's tokens with prompt logprobs.
Every position then has a top-2 on both sides (prefill chunks, prefix-cache hits and decode steps alike),
and both sides report the logprob of the token that actually follows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from click.testing import CliRunner  # noqa: E402
from fixtures_tiny_model import EOS_ID, _random_weights, _tokenizer  # noqa: E402
from fixtures_tiny_model import VOCAB_SIZE as TINY_VOCAB_SIZE  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from test_ops_cuda import GQA4_D128_SHAPE, QWEN2_SHAPE, QWEN3_SHAPE, SMOLLM2_SHAPE, random_weights  # noqa: E402
from teacher_forcing import teacher_forced, top2  # noqa: E402
from tiny_engine import ByteTokenizer, run_to_completion  # noqa: E402

from offline_paged.cli.main import cli  # noqa: E402
from offline_paged.core.config import EngineConfig  # noqa: E402
from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.engine import LLMEngine  # noqa: E402
from offline_paged.models.config import LlamaConfig  # noqa: E402

# Fewer layers than the real models keep the fp32 CPU side to seconds; widths, heads and vocab are real.
# Each architecture: Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral (a 32-token window, so the longer
# prompts and their decode read only the window, on both sides).
SHAPES = {"smollm2-d64-gqa3": SMOLLM2_SHAPE | dict(num_hidden_layers=6),
          "d128-gqa4": GQA4_D128_SHAPE | dict(num_hidden_layers=3),
          "qwen2": QWEN2_SHAPE | dict(num_hidden_layers=3),
          "qwen3": QWEN3_SHAPE | dict(num_hidden_layers=3),
          "mistral-window32": GQA4_D128_SHAPE | dict(num_hidden_layers=3, architecture="MistralForCausalLM",
                                                     sliding_window=32)}


@dataclass(frozen=True, slots=True)
class RandomModel:
    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tokenizer: ByteTokenizer
    source: str = "random"


def random_model(shape: dict, seed: int = 7) -> RandomModel:
    config = LlamaConfig(**shape)
    return RandomModel(config, random_weights(config, seed), ByteTokenizer())


def engine(model, device: str, **overrides) -> LLMEngine:
    settings = dict(device=device, block_size=16, num_kv_blocks=512, max_num_seqs=8,
                    max_num_batched_tokens=128) | overrides  # 128: longer prompts prefill in chunks
    return LLMEngine(EngineConfig(**settings), loaded_model=model)


def prompts(vocab_size: int) -> dict[str, list[int]]:
    """Six prompts, three sharing a 40-token prefix (prefix-cache hits), lengths across block edges."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, vocab_size, 40).tolist()
    lengths = [37, 64, 12, 100, 150, 90]
    result = {}
    for i, n in enumerate(lengths):
        tail = rng.integers(0, vocab_size, n).tolist()
        result[f"p{i}"] = shared + tail if i % 2 else tail
    return result


# Per dtype: (top-2 gap / scale that counts as decisive, least share of decisive positions, largest
# target-logprob error / scale). bf16 keeps 8 significant bits to fp16's 11: about 8x the noise.
BOUNDS = {"float16": (3e-3, 0.85, 2e-2), "bfloat16": (2.5e-2, 0.3, 8e-2)}


@pytest.mark.parametrize("dtype,cuda_graphs", [("float16", True), ("bfloat16", True), ("bfloat16", False)],
                         ids=["fp16-graphs", "bf16-graphs", "bf16-eager"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gpu_engine_matches_cpu_engine_teacher_forced(name, dtype, cuda_graphs):
    model = random_model(SHAPES[name])
    requests = prompts(model.config.vocab_size)
    gen = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    gpu_engine = engine(model, "cuda", dtype=dtype, cuda_graphs=cuda_graphs)
    assert gpu_engine.runner.kv_cache.dtype.name == dtype
    gpu = run_to_completion(gpu_engine, {k: (p, gen) for k, p in requests.items()})
    graphs = gpu_engine.runner.decode_graphs
    assert (graphs is not None and graphs.num_replays > 0) == cuda_graphs
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    forced = {k: (p + gpu[k].outputs[0].token_ids, score) for k, p in requests.items()}
    cpu = run_to_completion(engine(model, "cpu", dtype="float32"), forced)

    # The logprob of a random target spans the logit range, so it sets the scale for "fp16 noise":
    # a top-2 gap below 3e-3 of it is a coin toss for any correct fp16 run (as in test_ops_cuda).
    margin, least_decisive, max_error = BOUNDS[dtype]
    forced_run = teacher_forced(requests, gpu, cpu, margin)
    print(f"\n{name} {dtype} graphs={cuda_graphs}: {forced_run.summary()}")
    forced_run.check(least_decisive, max_error, decisive_agreement=0.99)
    assert forced_run.agree.mean() >= (0.98 if dtype == "float16" else 0.9)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_preempted_gpu_runs_equal_the_unpreempted_one(dtype):
    # Untied lm_head: with tied embeddings a random model mostly echoes its input token, so corrupted
    # context would go unnoticed; untied, the next token depends on the attended KV.
    model = random_model(SHAPES["smollm2-d64-gqa3"] | dict(num_hidden_layers=2, tie_word_embeddings=False))
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    requests = {f"r{i}": (rng.integers(0, model.config.vocab_size, int(n)).tolist(), params)
                for i, n in enumerate(rng.integers(8, 40, 8))}
    noise = 1.0 if dtype == "float16" else 8.0  # bf16 rounds 8x coarser: near-ties are 8x wider
    ample = engine(model, "cuda", dtype=dtype)
    reference = run_to_completion(ample, requests)
    assert ample.stats.num_preemptions == 0
    for mode in ("recompute", "swap"):
        tight = engine(model, "cuda", num_kv_blocks=12, preemption_mode=mode, dtype=dtype)
        results = run_to_completion(tight, requests)
        stats = tight.stats
        assert stats.num_preemptions > 0, mode
        if mode == "swap":
            assert stats.num_preemptions_swap > 0
        identical, worst = 0, 0.0
        for key in requests:
            want, got = reference[key].outputs[0], results[key].outputs[0]
            first = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
            same = got.token_ids if first is None else got.token_ids[:first]
            # Up to the first difference both runs saw the same context: same logprobs up to fp16 noise.
            for i, token in enumerate(same):
                worst = max(worst, abs(got.logprobs[i][token] - want.logprobs[i][token]))
            if first is None:
                identical += 1
                continue
            # fp16 over different batch shapes may flip a genuine near-tie, never a decisive choice.
            _, gap = top2(want.logprobs[first])
            assert gap < 0.05 * noise, f"{mode}: {key} diverges at output {first} with a top-2 gap of {gap:.3f}"
        print(f"\npreemption={mode}: {stats.num_preemptions} preemptions, {identical}/8 outputs identical, "
              f"max |logprob difference| before any divergence {worst:.2e}")
        assert worst < 0.25 * noise
        assert identical >= 6


def write_tiny_gpu_model(directory, torch_dtype: str = "float32"):
    """The CLI fixture's HF dir (byte-level tokenizer, ChatML) with head dim 64, which the kernels need;
    config.json says `torch_dtype` (the weights are float32 either way)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=TINY_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=500.0,
                         eos_token_ids=(EOS_ID,), max_position_embeddings=256)
    (directory / "config.json").write_text(json.dumps(config.to_dict() | {"eos_token_id": EOS_ID,
                                                                           "torch_dtype": torch_dtype}))
    save_file(_random_weights(config, 0), str(directory / "model.safetensors"))
    _tokenizer().save(directory)
    return directory


def test_cli_job_runs_on_the_gpu(tmp_path):
    model_dir = write_tiny_gpu_model(tmp_path / "model")
    job = [{"id": "plain", "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
           {"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "n": 2, "seed": 1},
           {"id": "eval", "prompt": "Paris is in France", "max_tokens": 1, "prompt_logprobs": 1}]
    job += [{"id": f"bulk{i}", "prompt": f"Item {i}:", "max_tokens": 8} for i in range(20)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in job))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(cli, ["generate", str(source), "-o", str(out), "--model", str(model_dir),
                                      "--device", "cuda", "--block-size", "16", "--num-kv-blocks", "64",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["error"] is None for r in records)
    assert sorted(r["id"] for r in records) == sorted(line["id"] for line in job)
    by_id = {r["id"]: r for r in records}
    assert len(by_id["plain"]["outputs"][0]["token_ids"]) == 5
    assert len(by_id["chat"]["outputs"]) == 2
    assert len(by_id["eval"]["prompt_logprobs"]) == len("Paris is in France")


@pytest.mark.parametrize("torch_dtype,expected", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                                  ("float32", "float16")])
def test_auto_dtype_follows_the_checkpoint_on_the_gpu(tmp_path, torch_dtype, expected):
    model_dir = write_tiny_gpu_model(tmp_path / "model", torch_dtype)
    llm = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", num_kv_blocks=64, max_model_len=128))
    assert llm.backend.dtype.name == expected
    assert llm.runner.kv_cache.dtype.name == expected
    results = run_to_completion(llm, {"a": ([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0,
                                                                      ignore_eos=True))})
    assert len(results["a"].outputs[0].token_ids) == 4
    cpu = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64, max_model_len=128))
    assert cpu.backend.dtype.name == "float32"


def test_cli_job_runs_in_bfloat16_with_and_without_graphs(tmp_path):
    model_dir = write_tiny_gpu_model(tmp_path / "model", "bfloat16")
    job = [{"id": f"r{i}", "prompt": f"Item {i}:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
           for i in range(6)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in job))
    for flag in ("--cuda-graphs", "--no-cuda-graphs"):
        out = tmp_path / f"out{flag}.jsonl"
        result = CliRunner().invoke(cli, ["generate", str(source), "-o", str(out), "--model", str(model_dir),
                                          "--device", "cuda", "--dtype", "bfloat16", "--num-kv-blocks", "64",
                                          flag, "--no-progress"])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert all(r["error"] is None and len(r["outputs"][0]["token_ids"]) == 6 for r in records)


def test_kv_pool_sized_after_a_profiling_forward():
    """Sizing from free memory runs a profiling step first: its activations are counted (at least the
    [T, 2I] MLP buffer of the largest step); the engine then runs."""
    model = random_model(SHAPES["d128-gqa4"])
    sized = {}
    for budget in (64, 2048):
        llm = engine(model, "cuda", num_kv_blocks=None, max_num_batched_tokens=budget, max_model_len=512,
                     gpu_memory_utilization=0.5)
        sized[budget] = llm.profiled_activation_bytes
        c = model.config
        assert sized[budget] >= budget * 2 * c.intermediate_size * 2  # fp16 gate_up of the whole step
        outputs = run_to_completion(llm, {"a": ([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))})
        assert len(outputs["a"].outputs[0].token_ids) == 4
        del llm
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"profiled activations: {sized}")
