"""`offline-paged generate` over hostile model directories: a bad config or checkpoint stops the job
before any work with exit 2 and one message naming the file and the field; a hostile chat template
costs only the chat lines it breaks (one error record each), promptly, never the job."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures_tiny_model import CHATML, PANIC_TEXT, make_tokenizer_panic, write_tiny_model
from sandbox_clock import count_sandbox_clock
from offline_paged.cli.main import cli
from offline_paged.models.chat_template import DEFAULT_MAX_SECONDS

FLAGS = ["--device", "cpu", "--block-size", "4", "--num-kv-blocks", "64", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--no-progress", "--max-tokens", "2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=64)


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def _run(model: Path, tmp_path: Path, lines: list[dict]):
    job = tmp_path / "in.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(out), "--model", str(model), *FLAGS])
    records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return result, {r["id"]: r for r in records}


HOSTILE_TEMPLATE = (
    "{% set c = messages[-1]['content'] %}"
    "{% if c == 'loops' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif c == 'repeat' %}{{ 'x' * 10**10 }}"
    "{% elif c == 'include' %}{% include 'evil.jinja' %}"
    "{% elif c == 'recurse' %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    "{% else %}" + CHATML + "{% endif %}")


def test_hostile_chat_template_costs_only_its_lines(model_dir, tmp_path, monkeypatch):
    model = _copy(model_dir, tmp_path)
    config_path = model / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"chat_template": HOSTILE_TEMPLATE}))
    lines = [{"id": "plain", "prompt": "The sky is"},
             {"id": "chat", "messages": [{"role": "user", "content": "Hi"}]}]
    lines += [{"id": c, "messages": [{"role": "user", "content": c}]} for c in ("loops", "repeat", "include", "recurse")]
    # The job runs in this process: its template work is counted in the sandbox's clock reads (1 µs each).
    clock = count_sandbox_clock(monkeypatch, step=1e-6)
    result, records = _run(model, tmp_path, lines)
    chat_lines = sum("messages" in line for line in lines)
    print(f"\n{clock.reads:,} clock reads for {chat_lines} chat lines")
    assert clock.reads <= chat_lines * (clock.reads_to(DEFAULT_MAX_SECONDS) + 1)  # a deadline's worth a line at most
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert set(records) == {line["id"] for line in lines}
    assert records["plain"]["error"] is None and records["chat"]["error"] is None
    for name, message in (("loops", "took longer than"), ("repeat", "over the limit"),
                          ("include", "not supported"), ("recurse", "calls nested deeper than")):
        error = records[name]["error"]
        assert error is not None and "tokenizer_config.json" in error["message"], (name, error)
        assert message in error["message"], (name, error)


@pytest.mark.parametrize("changes,message", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers must be an integer in 1..1024"),
    ({"num_hidden_layers": 7}, "num_hidden_layers is 7 in config.json, but the checkpoint holds 2 layers"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer in"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a finite number > 0"),
    ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object or null"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config (quant_method 'awq')"),
    ({"tie_word_embeddings": True}, "lm_head.weight differs from model.embed_tokens.weight"),
])
def test_hostile_config_stops_the_job_with_exit_2(model_dir, tmp_path, changes, message):
    model = _copy(model_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | changes))
    result, records = _run(model, tmp_path, [{"id": "a", "prompt": "x"}])
    assert result.exit_code == 2, result.output
    assert message in result.output and ("config.json" in result.output)
    assert "Traceback" not in result.output and records == {}


def test_config_that_is_a_list_stops_the_job_with_exit_2(model_dir, tmp_path):
    model = _copy(model_dir, tmp_path)
    (model / "config.json").write_text("[1, 2]")
    result, _ = _run(model, tmp_path, [{"id": "a", "prompt": "x"}])
    assert result.exit_code == 2 and "config.json: the config must be a JSON object, got list" in result.output


def test_a_tokenizer_that_panics_on_one_prompt_costs_only_that_line(model_dir, tmp_path):
    """A tokenizer.json whose Split regex backtracks past onig's limit: the Rust tokenizer panics
    (pyo3's PanicException is a BaseException); it used to end the job with exit 1 and 0 records, and
    every resume died again on the same line."""
    model = _copy(model_dir, tmp_path)
    make_tokenizer_panic(model)
    lines = [{"id": "plain", "prompt": "The sky is"}, {"id": "panic", "prompt": PANIC_TEXT},
             {"id": "chat-panic", "messages": [{"role": "user", "content": PANIC_TEXT}]},
             {"id": "last", "prompt": "Hi"}]
    for _ in range(2):  # the rerun resumes past it
        result, records = _run(model, tmp_path, lines)
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
    assert set(records) == {"plain", "panic", "chat-panic", "last"}
    assert records["plain"]["error"] is None and records["last"]["error"] is None
    for name in ("panic", "chat-panic"):
        assert "the tokenizer failed on this text" in records[name]["error"]["message"], records[name]
