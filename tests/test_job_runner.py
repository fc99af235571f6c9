"""The JSONL job loop with a fake engine: formats, per-line errors, resume, stop, streaming."""
import io
import json

import pytest

from fake_engine import FakeEngine, FakeTokenizer
from offline_paged.job.job_file import JsonlWriter, scan_and_repair
from offline_paged.job.job_input import read_lines
from offline_paged.job.job_output import is_error, record_key
from offline_paged.job.job_runner import EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_FAILED, JobRunner


class RecordingWriter(JsonlWriter):
    """A JsonlWriter on memory that also remembers the engine step at each write."""

    def __init__(self, engine=None):
        super().__init__(io.BytesIO())
        self.engine = engine
        self.steps_at_write: list[int] = []

    def write(self, record):
        super().write(record)
        self.steps_at_write.append(getattr(self.engine, "num_steps", 0))

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self._stream.getvalue().decode().splitlines()]


def _run(lines, engine=None, **kwargs):
    engine = engine or FakeEngine()
    writer = RecordingWriter(engine)
    summary = JobRunner(engine, writer, **kwargs).run([json.dumps(x) if not isinstance(x, str)
                                                        else x for x in lines])
    return summary, writer.records(), engine, writer


def test_native_prompt_lines_get_line_ids_text_and_usage():
    summary, records, _, _ = _run([{"prompt": "abc", "max_tokens": 2}, {"id": 7, "prompt": "xy"}])
    by_id = {r["id"]: r for r in records}
    assert set(by_id) == {"line-1", "7"}
    first = by_id["line-1"]
    assert first["line"] == 1 and first["text"] == "cb" and first["error"] is None
    assert first["outputs"][0]["token_ids"] == [ord("c"), ord("b")]
    assert first["outputs"][0]["finish_reason"] == "length"
    assert by_id["7"]["outputs"][0]["finish_reason"] == "eos"
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "cached_prompt_tokens": 0}
    assert (summary.num_succeeded, summary.num_failed, summary.exit_code) == (2, 0, EXIT_OK)
    assert (summary.num_prompt_tokens, summary.num_generated_tokens) == (5, 4)


def test_all_n_samples_and_logprobs_are_in_one_record():
    _, records, _, _ = _run([{"prompt": "ab", "n": 3, "logprobs": 1, "prompt_logprobs": 0}])
    (record,) = records
    assert [o["index"] for o in record["outputs"]] == [0, 1, 2]
    assert record["outputs"][1]["token_ids"] == [ord("b") + 1, ord("a") + 1]
    lp = record["outputs"][0]["logprobs"][0]
    assert lp == {"token_id": ord("b"), "logprob": -0.5,
                  "top_logprobs": [[ord("b"), -0.5], [ord("c"), -1.5]]}
    assert record["prompt_logprobs"][0] is None
    assert record["prompt_logprobs"][1]["token_id"] == ord("b")


def test_messages_use_the_chat_template_and_defaults_merge_under_line_fields():
    _, records, engine, _ = _run([{"messages": [{"role": "user", "content": "hi"}]},
                                  {"prompt": "abcdef", "max_tokens": 5}],
                                 defaults={"max_tokens": 3})
    by_id = {r["id"]: r for r in records}
    assert by_id["line-1"]["usage"]["prompt_tokens"] == len("<user>hi<assistant>")
    assert by_id["line-1"]["usage"]["completion_tokens"] == 3
    assert by_id["line-2"]["usage"]["completion_tokens"] == 5


def test_records_are_written_as_requests_finish_not_at_the_end():
    # prompt lengths 3, 1, 2 finish at steps 1, 2, 3 (1 + len % 3)
    _, records, engine, writer = _run([{"prompt": "abc"}, {"prompt": "a"}, {"prompt": "ab"}])
    assert [r["id"] for r in records] == ["line-1", "line-2", "line-3"]
    assert writer.steps_at_write == [1, 2, 3] and engine.num_steps == 3


def test_finishing_order_need_not_be_input_order():
    _, records, _, _ = _run([{"prompt": "ab"}, {"prompt": "abc"}])
    assert [r["id"] for r in records] == ["line-2", "line-1"]


BAD_LINES = [
    '{"prompt": "fine"}',
    '{"prompt": "unterminated',
    '[1, 2, 3]',
    '{"prompt": "x", "max_new_tokens": 5}',
    '{"id": "b", "max_tokens": 3}',
    '{"prompt": "x", "temperature": -1}',
    '{"id": "a", "prompt": "first"}',
    '{"id": "a", "prompt": "second"}',
    '{"prompt": "' + "z" * 60 + '"}',
    '{"prompt": "x", "prompt_token_ids": [1]}',
    '{"prompt": ""}',
    '{"custom_id": "c1", "method": "POST", "url": "/v1/audio/speech", "body": {"input": "x"}}',
    '{"custom_id": "c2", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}',
    '{"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "suffix": "y"}}',
    '{"prompt": "x", "use_beam_search": true, "temperature": 0, "repetition_penalty": 1.3}',
    '{"prompt": "x", "stop": [1]}',
]


def test_every_bad_line_gets_exactly_one_error_record_and_the_job_goes_on():
    summary, records, _, _ = _run(BAD_LINES + ["   ", '{"prompt": "last"}'])
    assert len(records) == len(BAD_LINES) + 1  # the blank line is ignored
    keys = [record_key(r) for r in records]
    assert len(set(keys)) == len(keys)
    errors = [r for r in records if is_error(r)]
    good = [r for r in records if not is_error(r)]
    assert {r["id"] for r in good} == {"line-1", "a", "line-18"}
    assert summary.num_failed == len(errors) == len(BAD_LINES) - 2
    assert summary.exit_code == EXIT_SOME_FAILED
    by_line = {r["line"]: r["error"] for r in errors if "line" in r}
    assert by_line[2]["type"] == "invalid_json"
    assert "max_new_tokens" in by_line[4]["message"]
    assert "temperature" in by_line[6]["message"]
    assert by_line[8]["type"] == "duplicate_id" and "'a'" in by_line[8]["message"]
    assert by_line[9]["type"] == "rejected" and "max_model_len" in by_line[9]["message"]
    assert all(e["message"].startswith(f"line {n}:") for n, e in by_line.items())
    openai = {r["custom_id"]: r["response"] for r in errors if "custom_id" in r}
    assert openai["c1"]["status_code"] == 404
    assert openai["c1"]["body"]["error"]["code"] == "unsupported_url"
    assert openai["c2"]["status_code"] == 405 and openai["c3"]["status_code"] == 400


def test_openai_completion_lines_get_batch_output_shape():
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "abc", "max_tokens": 2, "logprobs": 1, "n": 2}}
    _, (record,), _, _ = _run([line], model_name="tiny")
    assert record["custom_id"] == "q1" and record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body = response["body"]
    assert body["object"] == "text_completion" and body["model"] == "tiny"  # the model that ran, not the body's
    assert [c["text"] for c in body["choices"]] == ["cb", "dc"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"]["tokens"] == ["c", "b"]
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.5]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_openai_chat_lines_get_chat_completion_objects():
    line = {"custom_id": "q2", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
                "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 1}}
    _, (record,), _, _ = _run([line])
    body = record["response"]["body"]
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 4
    assert choice["finish_reason"] == "length"
    token = choice["logprobs"]["content"][0]
    assert token["token"] == ">" and token["bytes"] == [ord(">")]
    assert [t["token"] for t in token["top_logprobs"]] == [">"]  # exactly top_logprobs=1


def test_resume_skips_done_keys_including_duplicate_errors():
    lines = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}]
    _, first, _, _ = _run(lines)
    done = {record_key(r) for r in first}
    summary, second, engine, _ = _run(lines, done_keys=done)
    assert second == [] and engine.added == [] and summary.num_skipped == 3
    partial = {record_key(r) for r in first if r["id"] == "a" and not is_error(r)}
    _, third, engine, _ = _run(lines, done_keys=partial)
    assert engine.added == ["b"] and len(third) == 2


def test_should_stop_ends_cleanly_with_finished_records_kept():
    engine = FakeEngine()
    lines = [{"prompt": "abc"}, {"prompt": "a"}, {"prompt": "ab"}]  # finish at steps 1, 2, 3
    summary, records, _, _ = _run(lines, engine=engine, should_stop=lambda: engine.num_steps >= 2)
    assert [r["id"] for r in records] == ["line-1", "line-2"]
    assert summary.interrupted and summary.exit_code == EXIT_INTERRUPTED


def test_at_most_max_pending_requests_are_inside_the_engine():
    _, records, engine, _ = _run([{"prompt": "ab" * (i % 5 + 1)} for i in range(30)], max_pending=4)
    assert len(records) == 30 and engine.max_in_flight == 4


def test_summary_dict_has_the_reported_fields():
    summary, _, _, _ = _run([{"prompt": "abc"}])
    d = summary.to_dict()
    assert d["requests"] == 1 and d["generated_tokens"] == 3 and d["exit_code"] == 0
    assert d["engine"]["num_steps"] == 1 and d["generation_tokens_per_s"] > 0


def test_writer_puts_each_record_in_one_write_call():
    calls = []

    class Spy(io.BytesIO):
        def write(self, data):
            calls.append(bytes(data))
            return super().write(data)

    writer = JsonlWriter(Spy())
    writer.write({"id": "x", "text": "é\nline"})
    writer.write({"id": "y"})
    assert len(calls) == 2 and all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in calls)
    assert json.loads(calls[0]) == {"id": "x", "text": "é\nline"}


def test_scan_and_repair_truncates_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [{"id": "a", "line": 1, "text": "", "error": None},
            {"id": "b", "line": 2, "error": {"type": "rejected", "message": "no"}}]
    whole = "".join(json.dumps(r) + "\n" for r in good)
    out.write_text(whole + '{"id": "c", "line": 3, "te')
    state = scan_and_repair(out)
    assert state.done_keys == {"a", "b"} and state.num_errors == 1 and state.num_torn_bytes > 0
    assert out.read_text() == whole
    assert scan_and_repair(out).num_torn_bytes == 0  # idempotent


def test_scan_refuses_a_complete_line_that_is_not_a_record(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "line": 1, "error": null}\nnot json\n')
    with pytest.raises(ValueError, match="out.jsonl:2"):
        scan_and_repair(out)


DEEP = "[" * 10_000 + "]" * 10_000
HOSTILE_LINES = {  # line -> what its error message must say
    '{"prompt": "x", "stop": ' + DEEP + '}': "nested too deeply",
    '{"a": ' + DEEP + '}': "nested too deeply",
    '{"prompt": "x", "seed": ' + "9" * 4301 + '}': "too many digits",
    '{"prompt": "x", "temperature": 1' + "0" * 400 + '}': "temperature is too large",
    '{"prompt": "x", "top_p": 1' + "0" * 400 + '}': "top_p is too large",
    '{"id": "\\ud800", "prompt": "x"}': "lone surrogate",
    '{"prompt": "a\\udfffb"}': "lone surrogate",
    '{"messages": [{"role": "user", "content": "\\ud800"}]}': "lone surrogate",
    '{"custom_id": "\\udc00", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}':
        "lone surrogate",
    '{"prompt": "x", "n": 1000000000000}': "n must be <= 1024",
    '{"prompt": "x", "best_of": 1000000000000}': "best_of must be <= 1024",
    '{"prompt": "x\rmore"}': "invalid JSON",
    '{"prompt_token_ids": [5, -1]}': "non-negative integers",
    '{"prompt_token_ids": [5, true]}': "non-negative integers",
    '{"prompt_token_ids": [5, 6.0]}': "non-negative integers",
    '{"prompt": "x", "stop": [' + "1," * 50_000 + '1]}': "stop must be",
}


@pytest.mark.parametrize("line", list(HOSTILE_LINES), ids=range(len(HOSTILE_LINES)))
def test_a_hostile_line_gets_one_error_record_and_the_job_goes_on(line):
    summary, records, _, _ = _run([line, '{"id": "after", "prompt": "ok"}'])
    assert len(records) == 2 and summary.num_succeeded == 1
    (error,) = [r for r in records if is_error(r)]
    message = error["error"]["message"] if "line" in error else \
        error["response"]["body"]["error"]["message"]
    assert HOSTILE_LINES[line] in message and len(message) < 1000
    assert json.loads(json.dumps(error)) == error  # the id is writable UTF-8


def test_a_surrogate_id_is_written_as_its_escape_and_is_stable_for_resume():
    line = '{"id": "a\\ud800", "prompt": "x"}'
    _, (record,), _, writer = _run([line])
    assert record["id"] == "a\\ud800"
    summary, again, _, _ = _run([line], done_keys={record_key(record)})
    assert again == [] and summary.num_skipped == 1


def test_writer_escapes_a_lone_surrogate_instead_of_raising():
    stream = io.BytesIO()
    JsonlWriter(stream).write({"id": "x\ud800"})
    assert json.loads(stream.getvalue()) == {"id": "x\ud800"}


def test_read_lines_splits_on_newline_only_skips_a_bom_and_keeps_bad_utf8_for_its_line():
    data = (b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b",\r"max_tokens": 2}\n'
            b'{"prompt": "\xff"}\r\n{"prompt": "\xef\xbb\xbfc"}')
    lines = list(read_lines(io.BytesIO(data)))
    assert len(lines) == 4 and lines[0] == '{"prompt": "a"}'
    summary, records, _, _ = _run(lines)
    by_line = {r["line"]: r for r in records}
    assert set(by_line) == {1, 2, 3, 4} and summary.num_failed == 1
    assert "not valid UTF-8" in by_line[3]["error"]["message"]
    assert by_line[2]["usage"]["completion_tokens"] == 1  # one line, not two


def test_an_exception_of_any_kind_from_add_request_fails_only_its_line():
    class Picky(FakeEngine):
        def add_request(self, request_id, prompt=None, prompt_token_ids=None, params=None):
            if prompt == "boom":
                raise TypeError("tokenizer choked")
            super().add_request(request_id, prompt, prompt_token_ids, params)

    summary, records, _, _ = _run([{"prompt": "boom"}, {"prompt": "fine"}], engine=Picky())
    assert summary.num_failed == 1 and summary.num_succeeded == 1
    assert "TypeError: tokenizer choked" in records[0]["error"]["message"]


def test_scoring_lines_give_loglikelihood_and_is_greedy():
    lines = [{"id": "s", "context": "ab ", "continuation": "cd"},
             {"context": "x", "continuation": "y", "max_tokens": 3},
             {"id": "e", "context": "", "continuation": "y"}]
    summary, records, engine, _ = _run(lines, defaults={"max_tokens": 7})
    by_id = {r["id"]: r for r in records}
    # the fake engine gives every prompt token after the first a log-probability of -1.0
    assert by_id["s"]["loglikelihood"] == -3.0 and by_id["s"]["num_tokens"] == 3  # " cd"
    assert by_id["s"]["is_greedy"] is True and by_id["s"]["error"] is None
    assert "only id, context and continuation" in by_id["line-2"]["error"]["message"]
    assert "context must be a non-empty string" in by_id["e"]["error"]["message"]
    assert summary.num_succeeded == 1 and summary.num_failed == 2


def test_score_tokens_moves_trailing_spaces_to_the_continuation_as_lm_eval_does():
    from offline_paged.job.job_input import score_tokens

    encode = lambda text: list(text.encode())  # noqa: E731
    assert score_tokens(encode, "The sky is ", "blue") == (list(b"The sky is blue"), 5)
    assert score_tokens(encode, "   ", "x") == (list(b"   x"), 1)
    with pytest.raises(ValueError, match="no tokens"):
        score_tokens(lambda text: [], "a", "b")


def test_scoring_agrees_with_greedy_generation_on_a_tiny_real_model():
    from offline_paged.core.sampling_params import SamplingParams
    from tiny_engine import run_to_completion, tiny_engine

    engine = tiny_engine()
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    contexts = [f"ctx {i}:" for i in range(40)]
    outs = run_to_completion(engine, {c: (engine.tokenizer.encode(c), greedy) for c in contexts})
    printable = [(c, outs[c].outputs[0]) for c in contexts  # byte ids 4+32..4+126 round-trip
                 if all(36 <= t <= 130 for t in outs[c].outputs[0].token_ids)]
    assert printable, "no context with a printable greedy continuation"
    context, completion = printable[0]
    other = "".join(chr(((t - 4 - 32 + 1) % 95) + 32) for t in completion.token_ids)  # not greedy
    lines = [{"id": "greedy", "context": context, "continuation": completion.text},
             {"id": "other", "context": context, "continuation": other}]
    _, records, _, _ = _run(lines, engine=engine)
    by_id = {r["id"]: r for r in records}
    assert by_id["greedy"]["is_greedy"] is True and by_id["other"]["is_greedy"] is False
    assert by_id["greedy"]["num_tokens"] == 3
    assert by_id["greedy"]["loglikelihood"] == pytest.approx(completion.cumulative_logprob, abs=1e-9)
    assert by_id["other"]["loglikelihood"] < by_id["greedy"]["loglikelihood"]


def _openai(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_local_completions_asks():
    line = _openai("e", "/v1/completions", model="m", prompt=[[ord("a"), ord("b"), ord("c")]],
                   max_tokens=0, echo=True, logprobs=1, temperature=0)
    _, (record,), _, _ = _run([line])
    body = record["response"]["body"]
    (choice,) = body["choices"]
    assert choice["text"] == "abc" and body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"] == [None, -1.0, -1.0]  # the first token has none
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"b": -1.0}
    _, (generated,), _, _ = _run([_openai("g", "/v1/completions", prompt="ab", max_tokens=2,
                                          echo=True)])
    assert generated["response"]["body"]["choices"][0]["text"] == "abba"


def test_openai_fields_harmless_ignored_and_known_unsupported_refused_by_name():
    lines = [_openai("ok", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                     metadata={"k": "v"}, store=False, stream_options=None,
                     parallel_tool_calls=True, user="u"),
             _openai("tools", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                     tools=[{"type": "function"}]),
             _openai("format", "/v1/completions", prompt="x", response_format={"type": "json"}),
             _openai("zero", "/v1/completions", prompt="x", max_tokens=0)]
    _, records, _, _ = _run(lines)
    by_id = {r["custom_id"]: r["response"] for r in records}
    assert by_id["ok"]["status_code"] == 200
    assert by_id["tools"]["body"]["error"]["message"].endswith("tools is not supported")
    assert 'response_format type must be "text", "json_object" or "json_schema"' in by_id["format"]["body"]["error"]["message"]
    assert "max_tokens 0 needs echo" in by_id["zero"]["body"]["error"]["message"]


def test_openai_response_ids_are_unique_per_run_and_broken_lines_get_the_envelope():
    lines = [_openai("a", "/v1/completions", prompt="x"), '{"custom_id": "b", "method": "PO',
             '{"broken']
    _, first, _, _ = _run(lines)
    _, second, _, _ = _run(lines)
    assert all("custom_id" in r for r in first)  # OpenAI shape for the broken lines too
    assert {r["custom_id"] for r in first} == {"a", "b", "line-3"}
    ids = [r["id"] for r in first + second] + [r["response"]["request_id"] for r in first + second]
    assert len(set(ids)) == len(ids)
    assert {record_key(r) for r in first} == {record_key(r) for r in second}  # resume still works


class DeferredRefusalEngine(FakeEngine):
    """Refuses long prompts one step after add_request accepted them, as a data-parallel worker does."""

    def __init__(self) -> None:
        super().__init__(max_model_len=1000)
        self._refused: list[str] = []

    def add_request(self, request_id, prompt=None, prompt_token_ids=None, params=None) -> None:
        if prompt is not None and len(prompt) > 10:
            self._refused.append(request_id)
            return
        super().add_request(request_id, prompt, prompt_token_ids, params)

    def has_unfinished_requests(self) -> bool:
        return bool(self._refused) or super().has_unfinished_requests()

    def step(self):
        from offline_paged.core.outputs import RequestError

        refused, self._refused = self._refused, []
        return [RequestError(r, f"prompt of request {r} too long") for r in refused] + super().step()


def test_a_request_refused_after_it_was_added_gets_one_error_record():
    summary, records, _, _ = _run([{"id": "ok", "prompt": "ab"}, {"id": "long", "prompt": "x" * 20},
                                   {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "m", "prompt": "y" * 20}}],
                                  engine=DeferredRefusalEngine())
    by_key = {record_key(r): r for r in records}
    assert len(records) == 3 and set(by_key) == {"ok", "long", "oa"}
    assert by_key["long"]["error"] == {"type": "rejected",
                                       "message": "line 2: prompt of request long too long"}
    assert by_key["oa"]["response"]["status_code"] >= 400  # the OpenAI envelope, as for any refusal
    assert (summary.num_succeeded, summary.num_failed, summary.exit_code) == (1, 2, EXIT_SOME_FAILED)


class BosTokenizer(FakeTokenizer):
    """Byte ids behind a BOS (1) when special tokens are asked for; a text holding PANIC fails as a panicking Rust
    tokenizer does (ValueError, models/tokenizer.py)."""

    def encode(self, text, add_special_tokens=True):
        if "PANIC" in text:
            raise ValueError("the tokenizer failed on this text (PanicException)")
        return [1] * add_special_tokens + list(text.encode("utf-8"))


class BatchingTokenizer(BosTokenizer):
    def __init__(self):
        self.batches: list[tuple[int, bool]] = []  # (texts, add_special_tokens) of each encode_batch call
        self.renders = 0

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.renders += 1
        return super().apply_chat_template(messages, add_generation_prompt)

    def encode_batch(self, texts, add_special_tokens=True):
        self.batches.append((len(texts), add_special_tokens))
        if any("PANIC" in text for text in texts):
            raise ValueError("the tokenizer failed on one of these texts (PanicException)")
        return [self.encode(text, add_special_tokens) for text in texts]


def _records_by_id(tokenizer, lines, **kwargs):
    engine = FakeEngine(max_model_len=400)
    engine.tokenizer = tokenizer
    _, records, _, _ = _run(lines, engine=engine, **kwargs)
    return {r["id"]: r for r in records}


MIXED_LINES = [{"id": f"p{i}", "prompt": "ab" * (i + 1)} for i in range(5)] + [
    {"id": "chat", "messages": [{"role": "user", "content": "hi there"}]},
    {"id": "ids", "prompt_token_ids": [7, 8, 9]},
    {"id": "score", "context": "the sky is", "continuation": " blue"},
    {"id": "chat2", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]}]


def test_prompts_of_the_lines_read_together_are_tokenised_in_one_batch_each_way():
    """Text prompts (with BOS) and rendered chats (without: the template writes its own) go to encode_batch, one
    call each; the records equal those of a tokenizer that encodes one by one (add_request's path)."""
    batching = BatchingTokenizer()
    batched = _records_by_id(batching, MIXED_LINES)
    assert batching.batches == [(5, True), (2, False)]
    assert batched == _records_by_id(BosTokenizer(), MIXED_LINES)
    assert batched["p0"]["usage"]["prompt_tokens"] == 3 and all(r["error"] is None for r in batched.values())


def test_a_text_the_tokenizer_fails_on_fails_only_its_line_in_a_batch():
    lines = MIXED_LINES + [{"id": "bad", "prompt": "PANIC here"},
                           {"id": "bad-chat", "messages": [{"role": "user", "content": "PANIC"}]}]
    tokenizer = BatchingTokenizer()
    records = _records_by_id(tokenizer, lines)
    assert set(records) == {line["id"] for line in lines}
    assert tokenizer.renders == 3  # each chat rendered once, though its batch fell back to one by one
    for name in ("bad", "bad-chat"):
        assert "the tokenizer failed on this text" in records[name]["error"]["message"]
    good = {k: v for k, v in records.items() if not k.startswith("bad")}
    assert good == _records_by_id(BosTokenizer(), MIXED_LINES)


class TrickleEngine(FakeEngine):
    """Finishes two requests a step at most, as a busy engine does: room frees up a little at a time."""

    def step(self):
        self.num_steps += 1
        done = [rid for rid, (*_, due) in self._requests.items() if due <= self.num_steps][:2]
        return [self._output(rid, *self._requests.pop(rid)[:3]) for rid in done]


def test_lines_are_read_in_batches_once_room_is_free_and_max_pending_still_holds():
    tokenizer = BatchingTokenizer()
    lines = [{"id": i, "prompt": "ab" * (i % 7 + 1)} for i in range(300)]
    engine = TrickleEngine(max_model_len=400)
    engine.tokenizer = tokenizer
    _, records, _, _ = _run(lines, engine=engine, max_pending=64)
    sizes = [size for size, _ in tokenizer.batches]
    assert len(records) == 300 and engine.max_in_flight == 64
    assert sizes[0] == 64 and sum(sizes) == 300 and min(sizes[:-1]) >= 16  # 64 // 4; the last holds the rest
