"""OpenAI semantics of the job (job_input / job_output / the job loop's embeddings path) on a real tiny
engine: no max_tokens generates to the end of the context, logit_bias is mapped, response_format text is
accepted, a multi-prompt list is refused clearly, the response names the model that ran, usage carries
cached_tokens, and /v1/embeddings lines get OpenAI's embeddings body with the engine's vectors."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from fake_engine import FakeEngine
from fixtures_tiny_model import write_tiny_model

from offline_paged.core.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.job.job_file import JsonlWriter
from offline_paged.job.job_input import UNTIL_CONTEXT_END, LineError, parse_line
from offline_paged.job.job_runner import JobRunner

MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model = write_tiny_model(tmp_path_factory.mktemp("job-openai"), seed=2)
    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float64", block_size=4,
                                  num_kv_blocks=128, max_model_len=MAX_MODEL_LEN))


def _line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "gpt-4o", **body}}


def _run(engine, lines, **kwargs) -> dict[str, dict]:
    stream = io.BytesIO()
    JobRunner(engine, JsonlWriter(stream), model_name="tiny-served", **kwargs).run([json.dumps(x) for x in lines])
    records = [json.loads(r) for r in stream.getvalue().decode().splitlines()]
    return {r["custom_id"]: r["response"] for r in records}


def test_no_max_tokens_generates_to_the_end_of_the_context(engine):
    lines = [_line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], ignore_eos=True),
             _line("cmpl", "/v1/completions", prompt="abcdef", ignore_eos=True),
             _line("capped", "/v1/completions", prompt="abcdef", ignore_eos=True, max_tokens=3)]
    out = _run(engine, lines)
    for custom_id in ("chat", "cmpl"):
        usage = out[custom_id]["body"]["usage"]
        assert usage["total_tokens"] == MAX_MODEL_LEN and usage["completion_tokens"] > 16
        assert out[custom_id]["body"]["choices"][0]["finish_reason"] == "length"
    assert out["capped"]["body"]["usage"]["completion_tokens"] == 3
    native = parse_line(1, json.dumps({"prompt": "x"}), {})
    assert native.params.max_tokens == 16  # native lines keep vLLM's SamplingParams default
    assert parse_line(1, json.dumps(_line("d", "/v1/completions", prompt="x")), {"max_tokens": 5}).params.max_tokens == 5
    assert parse_line(1, json.dumps(_line("u", "/v1/completions", prompt="x")), {}).params.max_tokens == UNTIL_CONTEXT_END


def test_the_response_names_the_model_that_ran_and_counts_cached_tokens(engine):
    prompt = "the same long prompt, twice over"
    out = _run(engine, [_line("a", "/v1/completions", prompt=prompt, max_tokens=2)])
    again = _run(engine, [_line("b", "/v1/completions", prompt=prompt, max_tokens=2)])
    assert out["a"]["body"]["model"] == "tiny-served"  # never the body's "gpt-4o"
    cached = again["b"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached < again["b"]["body"]["usage"]["prompt_tokens"]


def test_logit_bias_is_mapped_and_response_format_text_accepted(engine):
    forced = ord("q")  # the tiny model's ids 0..255 are bytes
    out = _run(engine, [_line("b", "/v1/completions", prompt="abc", max_tokens=4, temperature=0.0,
                              logit_bias={str(forced): 100}, response_format={"type": "text"})])
    assert out["b"]["status_code"] == 200 and out["b"]["body"]["choices"][0]["text"] == "qqqq"
    bad = parse_line(1, json.dumps(_line("x", "/v1/completions", prompt="a", logit_bias={"1": 101})), {})
    assert isinstance(bad, LineError) and "between -100 and 100" in bad.message
    constrained = parse_line(1, json.dumps(_line("x", "/v1/completions", prompt="a",
                                                 response_format={"type": "json_object"})), {})
    assert not isinstance(constrained, LineError) and constrained.params.structured_outputs is not None
    refused = parse_line(1, json.dumps(_line("x", "/v1/completions", prompt="a",
                                             response_format={"type": "yaml"})), {})
    assert isinstance(refused, LineError) and "response_format type must be" in refused.message


def test_a_list_of_several_prompts_is_refused_with_the_way_out():
    error = parse_line(3, json.dumps(_line("x", "/v1/completions", prompt=["one", "two"])), {})
    assert isinstance(error, LineError) and "holds 2 prompts" in error.message and "own line" in error.message
    one = parse_line(3, json.dumps(_line("x", "/v1/completions", prompt=["one"])), {})
    assert one.prompt == "one"


def test_embeddings_lines_get_openai_embedding_bodies_with_the_engine_vectors(engine):
    lines = [_line("one", "/v1/embeddings", input="hello there"),
             _line("many", "/v1/embeddings", input=["ab", [104, 105]], encoding_format="float"),
             _line("empty", "/v1/embeddings", input=[]),
             _line("dims", "/v1/embeddings", input="x", dimensions=8),
             _line("long", "/v1/embeddings", input="y" * (MAX_MODEL_LEN + 1)),
             _line("after", "/v1/completions", prompt="ab", max_tokens=2)]
    out = _run(engine, lines)
    one = out["one"]["body"]
    assert one["object"] == "list" and one["model"] == "tiny-served"
    [expected] = engine.embed([engine.tokenizer.encode("hello there")])
    np.testing.assert_allclose(one["data"][0]["embedding"], expected, rtol=1e-6)
    assert one["usage"] == {"prompt_tokens": len(engine.tokenizer.encode("hello there")),
                            "total_tokens": len(engine.tokenizer.encode("hello there"))}
    many = out["many"]["body"]["data"]
    assert [d["index"] for d in many] == [0, 1] and all(d["object"] == "embedding" for d in many)
    np.testing.assert_allclose(many[1]["embedding"], engine.embed([[104, 105]])[0], rtol=1e-6)
    for bad, reason in (("empty", "input must be"), ("dims", "dimensions is not supported"), ("long", "max_model_len")):
        assert out[bad]["status_code"] == 400 and reason in out[bad]["body"]["error"]["message"]
    assert out["after"]["status_code"] == 200  # the job goes on


def test_an_engine_without_embeddings_gives_the_line_an_error():
    out = _run(FakeEngine(), [_line("e", "/v1/embeddings", input="x"), _line("c", "/v1/completions", prompt="ab")])
    assert "embeddings are not supported" in out["e"]["body"]["error"]["message"]
    assert out["c"]["status_code"] == 200
