"""`offline-paged generate` flags for vLLM users: --prompt-logprobs, --stop-token-ids, --chat-template,
--gpu-memory-utilization, --async/--sync-scheduling, -m, -h (tiny random HF model dir, CPU)."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures_tiny_model import VOCAB_SIZE, write_tiny_model
from offline_paged.cli.main import cli

FLAGS = ["--device", "cpu", "--block-size", "4", "--num-kv-blocks", "64", "--no-progress"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=64)


def _run(tmp_path, model_dir, lines, *flags):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli, ["generate", str(source), "-o", str(out), "-m", str(model_dir), *FLAGS,
                                      *flags])
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    return result, records


def test_prompt_logprobs_and_stop_token_ids_become_line_defaults(tmp_path, model_dir):
    every_id = ",".join(map(str, range(VOCAB_SIZE)))
    result, records = _run(tmp_path, model_dir, [{"id": "a", "prompt": "abc", "max_tokens": 5},
                                                 {"id": "b", "prompt": "abc", "max_tokens": 5, "stop_token_ids": []}],
                           "--prompt-logprobs", "1", "--stop-token-ids", every_id)
    assert result.exit_code == 0, result.output
    assert len(records["a"]["prompt_logprobs"]) == 3
    assert records["a"]["outputs"][0]["finish_reason"] == "stop"  # every id stops: one token
    assert len(records["a"]["outputs"][0]["token_ids"]) == 1
    assert len(records["b"]["outputs"][0]["token_ids"]) == 5  # the line's own value wins


def test_chat_template_file_replaces_the_models(tmp_path, model_dir):
    template = tmp_path / "t.jinja"
    template.write_text("T:{{ messages[0]['content'] }}|")
    line = {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    result, records = _run(tmp_path, model_dir, [line], "--chat-template", str(template))
    assert result.exit_code == 0, result.output
    assert records["c"]["usage"]["prompt_tokens"] == len("T:Hi|")  # one token per byte


def test_a_broken_chat_template_file_is_refused_before_the_model_loads(tmp_path, model_dir):
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}")
    result, records = _run(tmp_path, model_dir, [{"id": "x", "prompt": "a"}], "--chat-template", str(template))
    assert result.exit_code == 2 and "broken.jinja" in result.output and not records


@pytest.mark.parametrize("flags", [["--stop-token-ids", "1,x"], ["--gpu-memory-utilization", "1.5"]])
def test_bad_flag_values_exit_2_naming_the_problem(tmp_path, model_dir, flags):
    result, _ = _run(tmp_path, model_dir, [{"id": "x", "prompt": "a"}], *flags)
    assert result.exit_code == 2
    assert flags[0] in result.output or "gpu_memory_utilization" in result.output


def test_sync_and_async_scheduling_give_the_same_records(tmp_path, model_dir):
    """Same tokens; log-probabilities equal to float32 rounding (the batches differ in composition)."""
    lines = [{"id": f"r{i}", "prompt": "xyz" * (i + 1), "max_tokens": 6, "seed": i, "temperature": 0.9}
             for i in range(5)]
    runs = {}
    for mode in ("sync", "async"):
        (tmp_path / mode).mkdir()
        result, runs[mode] = _run(tmp_path / mode, model_dir, lines, f"--{mode}-scheduling")
        assert result.exit_code == 0, result.output
    assert sorted(runs["sync"]) == sorted(runs["async"]) == [f"r{i}" for i in range(5)]
    for key, record in runs["sync"].items():
        (want,), (got,) = record["outputs"], runs["async"][key]["outputs"]
        assert (got["token_ids"], got["finish_reason"]) == (want["token_ids"], want["finish_reason"])
        assert got["cumulative_logprob"] == pytest.approx(want["cumulative_logprob"], rel=1e-5)


def test_short_help_flag_shows_input_formats_and_exit_codes():
    result = CliRunner().invoke(cli, ["generate", "-h"])
    assert result.exit_code == 0
    assert "Exit codes" in result.output and "custom_id" in result.output and "-m, --model" in result.output


def test_progress_shows_tokens_per_second_before_any_request_finishes():
    from types import SimpleNamespace

    from offline_paged.cli.generate import _TqdmProgress
    from offline_paged.job.job_runner import JobSummary

    progress = _TqdmProgress(total=3)
    summary = JobSummary()
    summary.elapsed_s = 2.0  # nothing finished yet: the summary has counted no tokens
    progress.update(summary, SimpleNamespace(num_generated_tokens=50, kv_block_usage_current=0.25))
    assert "25.0 tok/s" in progress._bar.postfix and "KV 25%" in progress._bar.postfix
    progress.close()


def test_chat_template_kwargs_reach_the_template_in_native_and_openai_lines(tmp_path, model_dir):
    template = tmp_path / "t.jinja"
    template.write_text("{{ flavour }}:{{ messages[0]['content'] }}|")
    messages = [{"role": "user", "content": "Hi"}]
    lines = [{"id": "native", "messages": messages, "max_tokens": 1, "chat_template_kwargs": {"flavour": "abc"}},
             {"id": "on-prompt", "prompt": "x", "chat_template_kwargs": {"flavour": "abc"}},
             {"id": "not-object", "messages": messages, "chat_template_kwargs": ["abc"]}]
    result, records = _run(tmp_path, model_dir, lines, "--chat-template", str(template))
    assert result.exit_code == 1, result.output
    assert records["native"]["usage"]["prompt_tokens"] == len("abc:Hi|")
    assert "messages only" in records["on-prompt"]["error"]["message"]
    assert "must be an object" in records["not-object"]["error"]["message"]
    openai = {"custom_id": "oa", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": messages, "max_tokens": 1, "chat_template_kwargs": {"flavour": "z"}}}
    source, out = tmp_path / "oa.jsonl", tmp_path / "oa-out.jsonl"
    source.write_text(json.dumps(openai) + "\n")
    result = CliRunner().invoke(cli, ["generate", str(source), "-o", str(out), "-m", str(model_dir), *FLAGS,
                                      "--chat-template", str(template)])
    assert result.exit_code == 0, result.output
    (record,) = map(json.loads, out.read_text().splitlines())
    assert record["response"]["body"]["usage"]["prompt_tokens"] == len("z:Hi|")


def test_engine_options_shared_with_bench_reach_the_engine(tmp_path, model_dir):
    """--admission-batch (once bench's only), a --kv-cache-memory size and vLLM's --dtype float reach
    the EngineConfig generate builds."""
    from offline_paged.cli.generate import _build_engine

    args = [str(tmp_path / "in.jsonl"), "-m", str(model_dir), *FLAGS, "--admission-batch", "3",
            "--kv-cache-memory", "1MiB", "--dtype", "float"]
    options = cli.commands["generate"].make_context("generate", args).params
    config = _build_engine(options).config
    assert (config.admission_batch, config.kv_cache_memory, config.dtype) == (3, 1 << 20, "float32")
    assert config.num_kv_blocks == 64 and config.block_size == 4
