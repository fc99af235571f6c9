"""The benchmark's non-timing logic: workloads, roofline counts, one run's bookkeeping
on a tiny CPU engine, report formatting, and the CLI's argument errors. No timing thresholds.
(Dummy weights: test_dummy_weights.py.)"""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from tiny_engine import VOCAB_SIZE, tiny_model

from offline_paged.benchmark.bench import (BenchRequest, RooflineModel, file_workload, max_total_len,
                                           parse_length_range, random_workload, run_bench, sharegpt_like_workload,
                                           warm_up)
from offline_paged.benchmark.bench_report import format_report
from offline_paged.cli.main import cli
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine
from offline_paged.models.dummy_weights import DummyTokenizer


# ------------------------------------------------------------------------------ workloads
@pytest.mark.parametrize("text, expected", [("100:1024", (100, 1024)), ("7", (7, 7)), ("3:3", (3, 3))])
def test_parse_length_range(text, expected):
    assert parse_length_range(text) == expected


@pytest.mark.parametrize("text", ["", "a:b", "0:5", "9:3", "1:2:3", "-4"])
def test_parse_length_range_rejects(text):
    with pytest.raises(ValueError, match="length range"):
        parse_length_range(text)


def test_random_workload_is_seeded_exact_and_in_range():
    requests = random_workload(50, (3, 9), (2, 5), vocab_size=11, seed=4)
    assert requests == random_workload(50, (3, 9), (2, 5), vocab_size=11, seed=4)
    assert requests != random_workload(50, (3, 9), (2, 5), vocab_size=11, seed=5)
    for r in requests:
        assert 3 <= len(r.prompt_token_ids) <= 9
        assert all(0 <= t < 11 for t in r.prompt_token_ids)
        assert 2 <= r.params.max_tokens <= 5
        assert r.params.min_tokens == r.params.max_tokens and r.params.ignore_eos
    assert {len(r.prompt_token_ids) for r in requests} == set(range(3, 10))  # the whole range is drawn
    assert max_total_len(requests) == max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)


def test_random_workload_defaults_match_the_issue():
    requests = random_workload(vocab_size=100)
    assert len(requests) == 256
    assert min(len(r.prompt_token_ids) for r in requests) >= 100
    assert max(r.params.max_tokens for r in requests) <= 1024


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(input_len=(5, 2)), dict(output_len=(0, 3))])
def test_random_workload_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        random_workload(**({"vocab_size": 10} | kwargs))


def test_sharegpt_like_workload_is_seeded_with_sharegpts_means_and_a_long_tail():
    requests = sharegpt_like_workload(4096, vocab_size=50, seed=3)
    assert requests == sharegpt_like_workload(4096, vocab_size=50, seed=3)
    assert requests != sharegpt_like_workload(4096, vocab_size=50, seed=4)
    inputs = np.array([len(r.prompt_token_ids) for r in requests])
    outputs = np.array([r.params.max_tokens for r in requests])
    assert inputs.min() >= 4 and outputs.min() >= 4 and max(inputs.max(), outputs.max()) <= 2048
    # the means of the published distribution (clipping moves them by well under 5%)
    assert abs(inputs.mean() / 161.31 - 1) < 0.08 and abs(outputs.mean() / 337.99 - 1) < 0.08
    assert np.median(outputs) < 0.8 * outputs.mean()  # log-normal: a long right tail, not uniform
    assert all(r.params.min_tokens == r.params.max_tokens and r.params.ignore_eos for r in requests)
    assert all(0 <= t < 50 for r in requests[:50] for t in r.prompt_token_ids)


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(max_len=3)])
def test_sharegpt_like_workload_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        sharegpt_like_workload(**kwargs)


def test_file_workload_tokenizes_every_kind_of_line(tmp_path):
    path = tmp_path / "job.jsonl"
    lines = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 3}, {"prompt": "hi", "max_tokens": 2},
             {"messages": [{"role": "user", "content": "yo"}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = file_workload(path, tiny_model().tokenizer)
    assert [r.prompt_token_ids[:3] for r in requests][0] == [5, 6, 7]
    assert requests[1].prompt_token_ids == tiny_model().tokenizer.encode("hi")
    assert requests[1].params.max_tokens == 2
    assert len(requests) == 3


def test_file_workload_names_the_bad_line(tmp_path):
    path = tmp_path / "job.jsonl"
    path.write_text('{"prompt_token_ids": [1]}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=":2:"):
        file_workload(path, tiny_model().tokenizer)


def test_file_workload_with_text_and_dummy_weights_says_why(tmp_path):
    path = tmp_path / "job.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    with pytest.raises(ValueError, match="prompt_token_ids"):
        file_workload(path, DummyTokenizer(()))


# ------------------------------------------------------------------------------ roofline
class _Item:
    def __init__(self, start, q, samples=1, prompt_logprobs=None):
        self.start, self.num_new_tokens, self.num_samples, self.prompt_logprobs = start, q, samples, prompt_logprobs


def test_roofline_counts_by_hand():
    config = tiny_model().config  # E 32, I 64, L 2, H 4, Hkv 2, D 8, V 260
    model = RooflineModel(config, itemsize=2)
    per_layer = 32 * (32 + 2 * 16) + 32 * 32 + 3 * 32 * 64
    assert model.linear_params == 2 * per_layer
    kv_token = 2 * 2 * 16 * 2
    decode, prefill = _Item(start=10, q=1), _Item(start=0, q=4, samples=0)
    bytes_moved, flops = model.step_cost([decode, prefill])
    weights = (2 * per_layer + 260 * 32) * 2
    assert bytes_moved == weights + (11 + 4) * kv_token + 5 * kv_token + 1 * 260 * 4
    keys = 11 + (1 + 2 + 3 + 4)
    assert flops == 2 * 5 * 2 * per_layer + 2 * 1 * 260 * 32 + keys * 2 * 4 * 32


def test_roofline_counts_fp8_kv_bytes_at_one_byte_an_element():
    """An FP8 KV cache halves the KV bytes a step reads and writes; weights and FLOPs stay the same."""
    config = tiny_model().config
    step = [_Item(start=10, q=1), _Item(start=0, q=4, samples=0)]
    (bf16_bytes, bf16_flops) = RooflineModel(config, itemsize=2).step_cost(step)
    (fp8_bytes, fp8_flops) = RooflineModel(config, itemsize=2, kv_itemsize=1).step_cost(step)
    kv_token_bf16 = 2 * 2 * 16 * 2  # L * (K, V) * Hkv D * 2 bytes
    assert bf16_bytes - fp8_bytes == ((11 + 4) + 5) * kv_token_bf16 // 2
    assert fp8_flops == bf16_flops


# ------------------------------------------------------------------------------ one run
def _engine(layout="paged", num_blocks=40, block_size=4):
    config = EngineConfig(device="cpu", block_size=block_size, num_kv_blocks=num_blocks, max_model_len=40,
                          kv_layout=layout, max_num_batched_tokens=64)
    return LLMEngine(config, loaded_model=tiny_model())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_runs_a_step_that_prefills_beside_decodes(async_scheduling):
    """The mixed step's first call compiles kernels and imports modules on CUDA: the warm-up pays that."""
    engine = LLMEngine(EngineConfig(device="cpu", block_size=4, num_kv_blocks=200, max_model_len=200,
                                    async_scheduling=async_scheduling), loaded_model=tiny_model())
    schedule, kinds = engine.scheduler.schedule, []

    def recording():
        output = schedule()
        kinds.append({item.num_new_tokens > 1 for item in output.scheduled})  # True: a prefill chunk
        return output

    engine.scheduler.schedule = recording
    warm_up(engine, VOCAB_SIZE)
    assert {True, False} in kinds
    assert not engine.has_unfinished_requests()


def test_run_bench_counts_exact_tokens_and_records_every_step():
    requests = random_workload(12, (4, 20), (3, 12), vocab_size=VOCAB_SIZE, seed=1)
    engine = _engine()
    warm_up(engine, VOCAB_SIZE)
    result = run_bench(engine, requests, label="paged")
    assert result.num_output_tokens == sum(r.params.max_tokens for r in requests)
    assert result.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert result.steps and all(s.num_seqs > 0 for s in result.steps)
    assert result.peak_device_memory is None and result.roofline() is None
    assert 0 < result.kv_utilization <= 1
    assert result.max_concurrent_seqs == max(s.num_seqs for s in result.steps)
    split = result.time_split()
    assert split["num_steps"] == len(result.steps) and split["forward_device_ms"] is None
    summary = json.loads(result.to_json(with_steps=True))
    assert summary["num_output_tokens"] == result.num_output_tokens
    assert len(summary["steps"]) == len(result.steps)


def test_run_bench_reads_the_step_report_and_patches_nothing():
    engine = _engine()
    patched_before = {name: set(vars(obj)) for name, obj in
                      (("scheduler", engine.scheduler), ("runner", engine.runner), ("model", engine.runner.model))}
    result = run_bench(engine, random_workload(6, (4, 12), (2, 6), vocab_size=VOCAB_SIZE, seed=3))
    for name, obj in (("scheduler", engine.scheduler), ("runner", engine.runner), ("model", engine.runner.model)):
        assert set(vars(obj)) == patched_before[name], f"run_bench changed the {name} instance"
    for step in result.steps:
        assert step.forward_s is None and not step.cuda_graph  # CPU: no device timer, no graphs
        assert 0 <= step.schedule_s + step.execute_s + step.postprocess_s <= step.wall_s
        assert 0 <= step.token_wait_s + step.mask_dispatch_s <= step.postprocess_s
    assert sum(s.num_tokens for s in result.steps) == result.num_prompt_tokens + result.num_output_tokens - 6


def test_step_with_report_describes_the_step():
    engine = _engine()
    engine.add_request("a", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2, ignore_eos=True))
    outputs, report = engine.step_with_report()
    assert outputs == [] and [item.seq.group.request_id for item in report.scheduled] == ["a"]
    assert report.num_tokens == 3 and report.forward_timer is None and not report.used_cuda_graph
    assert min(report.schedule_s, report.execute_s, report.postprocess_s) >= 0
    outputs, report = engine.step_with_report()
    assert [o.request_id for o in outputs] == ["a"] and report.num_tokens == 1


def test_contiguous_layout_admits_fewer_sequences_on_the_same_pool():
    requests = random_workload(12, (4, 8), (8, 12), vocab_size=VOCAB_SIZE, seed=2)
    paged = run_bench(_engine("paged", num_blocks=30), requests, kv_layout="paged")
    contiguous = run_bench(_engine("contiguous", num_blocks=30), requests, kv_layout="contiguous")
    assert contiguous.num_output_tokens == paged.num_output_tokens
    assert contiguous.max_concurrent_seqs == 30 // (40 // 4)  # each holds max_model_len = 10 blocks
    assert paged.max_concurrent_seqs > contiguous.max_concurrent_seqs
    assert paged.kv_utilization > contiguous.kv_utilization
    report = format_report([paged, contiguous], header="hdr")
    assert report.splitlines()[0] == "hdr"
    assert "vs paged" in report and "1.00x" in report
    assert "contiguous KV, block size 4" in report


def test_run_bench_on_requests_with_eos_allowed_still_finishes():
    engine = _engine()
    requests = [BenchRequest([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))]
    result = run_bench(engine, requests)
    assert 1 <= result.num_output_tokens <= 5


# ------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize("args, message", [
    (["--model", "x", "--dummy-weights", "smollm2-135m"], "not both"),
    (["--dummy-weights", "gpt-5"], "choose from"),
    (["--input-len", "9:3"], "length range"),
    (["--workload", "file"], "--input-file"),
    (["--json-steps"], "--json"),
    (["--block-size", "0"], "block-size"),
    (["--kv-layout", "dense"], "kv-layout"),
])
def test_cli_argument_errors(args, message):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_cli_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    import offline_paged.benchmark.bench_report as report

    monkeypatch.setattr(report, "matplotlib_available", lambda: False)
    result = CliRunner().invoke(cli, ["bench", "--plot", "kv.png"])
    assert result.exit_code == 2
    assert "matplotlib" in result.output


def test_cli_runs_a_file_workload_on_a_tiny_model(tmp_path):
    from fixtures_tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny")
    job = tmp_path / "job.jsonl"
    job.write_text('{"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": true}\n'
                   '{"prompt": "hello", "max_tokens": 3, "ignore_eos": true}\n')
    result = CliRunner().invoke(cli, ["bench", "--model", str(model_dir), "--device", "cpu",
                                      "--workload", "file", "--input-file", str(job), "--no-roofline",
                                      "--no-warmup", "--json", "--kv-layout", "paged",
                                      "--kv-layout", "contiguous"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.splitlines()[-1])
    assert [r["kv_layout"] for r in data["runs"]] == ["paged", "contiguous"]
    assert all(r["num_output_tokens"] == 7 for r in data["runs"])


def test_cli_runs_the_sharegpt_like_dataset_and_names_it():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--dataset",
                                      "sharegpt-like", "--num-requests", "3", "--seed", "1", "--no-roofline",
                                      "--no-warmup", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.splitlines()[-1])
    assert "sharegpt-like N=3" in data["header"]
    assert data["runs"][0]["max_num_seqs"] == 256  # the engine's, resolved (the CPU's default)
    assert data["runs"][0]["engine_start_s"] > 0  # the engine's construction, timed apart from the run
    expected = sharegpt_like_workload(3, vocab_size=100, seed=1)
    assert data["runs"][0]["num_output_tokens"] == sum(r.params.max_tokens for r in expected)


def test_cli_compares_kv_cache_dtypes_in_one_call():
    """--kv-cache-dtype given twice: one run per value in this process, each record naming its KV dtype in
    its label and fields (and the header), the FP8 run's roofline floor counting 1-byte KV elements."""
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "3",
                                      "--input-len", "20", "--output-len", "4", "--no-warmup", "--json",
                                      "--kv-cache-dtype", "fp8", "--kv-cache-dtype", "auto"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.splitlines()[-1])
    assert [r["kv_cache_dtype"] for r in data["runs"]] == ["fp8_e4m3", "auto"]
    assert [r["label"] for r in data["runs"]] == ["paged kv=fp8_e4m3", "paged kv=auto"]
    assert all(r["quantization"] is None for r in data["runs"])
    assert "kv cache auto/fp8_e4m3" in data["header"] and data["kv_cache_dtype"] == "auto/fp8_e4m3"
    fp8, auto = data["runs"]
    assert fp8["num_output_tokens"] == auto["num_output_tokens"] == 12
    assert fp8["roofline"]["floor_s"] < auto["roofline"]["floor_s"]  # fewer KV bytes (float32 vs 1 byte)


def test_cli_refuses_several_kv_cache_dtypes_with_data_parallel():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--data-parallel-size",
                                      "2", "--kv-cache-dtype", "fp8", "--kv-cache-dtype", "auto"])
    assert result.exit_code == 2 and "several --kv-cache-dtype values" in result.output


def test_cli_compares_weight_quantizations_in_one_call():
    """--quantization none --quantization fp8: one run per value (times each --kv-cache-dtype) in this process,
    each record naming its quantization in its label and fields, the header naming both, the FP8 runs' roofline
    floor counting 1-byte linear weights (and their scales)."""
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "3",
                                      "--input-len", "20", "--output-len", "4", "--no-warmup", "--json",
                                      "--quantization", "none", "--quantization", "fp8",
                                      "--kv-cache-dtype", "auto", "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.splitlines()[-1])
    assert [r["quantization"] for r in data["runs"]] == [None, None, "fp8", "fp8"]
    assert [r["label"] for r in data["runs"]] == ["paged kv=auto w=none", "paged kv=fp8_e4m3 w=none",
                                                  "paged kv=auto w=fp8", "paged kv=fp8_e4m3 w=fp8"]
    assert "quantization none/fp8" in data["header"] and data["quantization"] == "none/fp8"
    plain, _, fp8, _ = data["runs"]
    assert fp8["num_output_tokens"] == plain["num_output_tokens"] == 12
    assert fp8["roofline"]["floor_s"] < plain["roofline"]["floor_s"]  # 1-byte linear weights


def test_cli_refuses_several_quantizations_with_data_parallel():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--data-parallel-size",
                                      "2", "--quantization", "none", "--quantization", "fp8"])
    assert result.exit_code == 2 and "several --quantization values" in result.output


def test_the_json_record_names_the_host_cpus():
    import os

    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "2",
                                      "--no-roofline", "--no-warmup", "--json"])
    assert result.exit_code == 0, result.output
    host = json.loads(result.stdout.splitlines()[-1])["host"]
    assert host["cpus"] == len(os.sched_getaffinity(0))
    assert host["physical_cores"] is None or 1 <= host["physical_cores"] <= host["cpus"]
    assert host["quota_cpus"] is None or host["quota_cpus"] > 0
