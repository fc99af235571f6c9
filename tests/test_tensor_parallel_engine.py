"""Tensor-parallel engine plumbing on the CPU: rank 0 (this process) runs the scheduler and sends each
step's inputs to a spawned rank over a pipe; the collectives run over pipes too. Outputs must equal
the one-process engine's: greedy, seeded sampling, n>1, prefix hits, logprobs, and preemption under
a small pool (recompute and swap, so block copies and swaps cross to the other rank too)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine
from tiny_engine import run_to_completion, tiny_model


def _requests(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(4, 260, size=9).tolist()
    requests = {}
    for i in range(8):
        prompt = (prefix if i % 2 else []) + rng.integers(4, 260, size=int(rng.integers(3, 30))).tolist()
        params = (SamplingParams(max_tokens=16, temperature=0.0, logprobs=2) if i % 3 == 0 else
                  SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=i, n=2 if i == 4 else 1))
        requests[f"r{i}"] = (prompt, params)
    return requests


def _run(tensor_parallel_size: int, **overrides) -> dict:
    settings = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=24, max_num_seqs=8,
                    max_num_batched_tokens=48, tensor_parallel_size=tensor_parallel_size) | overrides
    engine = LLMEngine(EngineConfig(**settings), loaded_model=tiny_model())
    try:
        results = run_to_completion(engine, _requests())
        return {rid: [(c.token_ids, c.logprobs) for c in out.outputs] for rid, out in results.items()}, engine
    finally:
        engine.close()


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_two_cpu_ranks_give_the_single_process_outputs(preemption_mode):
    single, _ = _run(1, preemption_mode=preemption_mode, num_cpu_blocks=64)
    sharded, engine = _run(2, preemption_mode=preemption_mode, num_cpu_blocks=64)
    assert engine.runner.kv_cache.shape[4] == 1  # 2 KV heads over 2 ranks
    assert engine.stats.num_preemptions > 0  # the small pool really preempted
    assert set(sharded) == set(single)
    for rid in single:
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(sharded[rid], single[rid], strict=True):
            assert tokens == want_tokens, rid
            if want_logprobs:
                for got, want in zip(logprobs, want_logprobs):
                    assert got.keys() == want.keys()
                    # float32 logits (the forward's output dtype): sums split over ranks round apart
                    np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-5)


def test_tensor_parallel_refuses_a_split_that_does_not_divide():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads"):
        LLMEngine(EngineConfig(device="cpu", tensor_parallel_size=3, num_kv_blocks=8), loaded_model=tiny_model())


def test_tensor_parallel_refuses_async_scheduling():
    config = EngineConfig(device="cpu", dtype="float64", tensor_parallel_size=2, num_kv_blocks=16,
                          async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor_parallel_size"):
        LLMEngine(config, loaded_model=tiny_model())


def test_tensor_parallel_size_is_validated():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_llm_with_tensor_parallel_size_two_generates_what_one_process_does():
    from offline_paged import LLM

    prompts = [{"prompt_token_ids": [5, 80, 33, 90, 12]}, {"prompt_token_ids": [100, 7, 7, 250]}]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    outputs = {}
    for size in (1, 2):
        with LLM(device="cpu", dtype="float64", loaded_model=tiny_model(), num_kv_blocks=32, block_size=4,
                 tensor_parallel_size=size) as llm:
            outputs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[2] == outputs[1] and all(len(t) == 8 for t in outputs[1])


def test_cli_generate_with_tensor_parallel_size(tmp_path):
    """`generate --tensor-parallel-size 2` on the CPU: the same records as one process."""
    from click.testing import CliRunner

    from offline_paged.cli.main import cli
    from tiny_llama import make_tiny_hf_model, write_tiny_tokenizer

    model_dir = tmp_path / "model"
    make_tiny_hf_model(model_dir)
    write_tiny_tokenizer(model_dir, 97)
    job = tmp_path / "job.jsonl"
    job.write_text('{"id": "a", "prompt_token_ids": [5, 9, 30, 2], "max_tokens": 6, "temperature": 0}\n'
                   '{"id": "b", "prompt_token_ids": [50, 60], "max_tokens": 5, "temperature": 0.7, "seed": 1}\n')
    records = {}
    for size in (1, 2):
        out = tmp_path / f"out{size}.jsonl"
        result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(out), "--model", str(model_dir),
                                           "--device", "cpu", "--num-kv-blocks", "64",
                                           "--tensor-parallel-size", str(size)])
        assert result.exit_code == 0, result.output
        records[size] = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    assert len(records[1]) == 2
    for got, want in zip(records[2], records[1]):
        # float32 logits: the split sums round apart, so the cumulative log-probability only nearly agrees
        got_lp, want_lp = (r["outputs"][0].pop("cumulative_logprob") for r in (got, want))
        assert got == want
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
