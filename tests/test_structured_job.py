"""Structured output in a JSONL job on the tiny model: native structured_outputs and guided_* lines,
OpenAI response_format lines, and one error record per bad line while the others run."""
import io
import json

import jsonschema

from offline_paged.job.job_file import JsonlWriter
from offline_paged.job.job_output import is_error
from offline_paged.job.job_runner import JobRunner
from tiny_engine import tiny_engine

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def _run(lines: list[dict]) -> dict:
    stream = io.BytesIO()
    JobRunner(tiny_engine(), JsonlWriter(stream)).run([json.dumps(line) for line in lines])
    records = [json.loads(line) for line in stream.getvalue().decode().splitlines()]
    return {r.get("custom_id", r.get("id")): r for r in records}


def _chat(custom_id: str, response_format: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0.0,
                     "response_format": response_format}}


def test_every_way_of_asking_gives_valid_output_and_bad_lines_get_their_own_error():
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    records = _run([
        {"id": "native", "prompt": "x", "max_tokens": 200, "temperature": 1.0, "seed": 1, "structured_outputs": compact},
        {"id": "guided", "prompt": "x", "max_tokens": 20, "guided_choice": ["left", "right"]},
        {"id": "regex", "prompt": "x", "max_tokens": 20, "guided_regex": "[a-f]{4}"},
        {"id": "bad-schema", "prompt": "x", "guided_json": {"type": "nonsense"}},
        {"id": "bad-regex", "prompt": "x", "guided_regex": "(unclosed"},
        {"id": "two-ways", "prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}},
        _chat("openai-schema", {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}),
        _chat("openai-bad", {"type": "json_schema", "json_schema": {"name": "s"}}),
        {"custom_id": "openai-object", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 5, "response_format": {"type": "json_object"}}},
    ])
    assert len(records) == 9
    jsonschema.validate(json.loads(records["native"]["outputs"][0]["text"]), SCHEMA)
    assert records["guided"]["outputs"][0]["text"] in ("left", "right")
    assert len(records["regex"]["outputs"][0]["text"]) == 4
    for key, words in (("bad-schema", "json"), ("bad-regex", "regex"), ("two-ways", "give one of")):
        assert is_error(records[key]) and words in records[key]["error"]["message"], records[key]
    chat = records["openai-schema"]["response"]["body"]["choices"][0]["message"]["content"]
    assert records["openai-schema"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(chat), SCHEMA)
    assert is_error(records["openai-bad"]) and "schema" in json.dumps(records["openai-bad"])
    text = records["openai-object"]["response"]["body"]["choices"][0]["text"]
    assert text.startswith("{")


def test_a_beam_search_line_with_a_grammar_returns_valid_beams_and_a_dead_one_gets_an_error_record():
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    records = _run([
        {"id": "beams", "prompt": "x", "max_tokens": 60, "n": 3, "use_beam_search": True, "temperature": 0,
         "structured_outputs": compact},
        {"id": "dead", "prompt": "x", "max_tokens": 5, "n": 2, "use_beam_search": True, "temperature": 0,
         "min_tokens": 1, "stop_token_ids": [101, 102, 103], "guided_regex": "[a-c]x"},  # a, b, c banned at first
    ])
    texts = [o["text"] for o in records["beams"]["outputs"]]
    assert len(texts) == 3 and len(set(texts)) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert is_error(records["dead"]) and "no beam is left" in records["dead"]["error"]["message"]
