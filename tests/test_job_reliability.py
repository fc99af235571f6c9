"""Issue 29's job-level rows, with the fake engine: bounded lines, a panicking tokenizer, resume by
request hash and by record shape, requests left for a rerun when their workers died, cut error
messages and capped output costs."""
import io
import json

import pytest

from fake_engine import FakeEngine, FakeTokenizer
from offline_paged.core.outputs import RequestError
from offline_paged.job.job_file import JsonlWriter, is_output_record, open_output, scan_and_repair
from offline_paged.job.job_input import OversizedLine, default_max_line_bytes, read_lines
from offline_paged.job.job_output import is_error, record_key
from offline_paged.job.job_runner import (EXIT_INCOMPLETE, EXIT_OK, EXIT_SOME_FAILED, MAX_ERROR_MESSAGE_CHARS,
                                          InputChangedError, JobRunner)


def _run(lines, engine=None, **kwargs):
    engine = engine or FakeEngine()
    stream = io.BytesIO()
    summary = JobRunner(engine, JsonlWriter(stream), **kwargs).run(
        [x if isinstance(x, (str, OversizedLine)) else json.dumps(x) for x in lines])
    return summary, [json.loads(line) for line in stream.getvalue().decode().splitlines()]


# ----------------------------------------------------------------------------- bounded lines
class CountingStream(io.BytesIO):
    """A binary stream that counts the most bytes any one read handed out."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.largest_read = 0

    def readline(self, size=-1):
        chunk = super().readline(size)
        self.largest_read = max(self.largest_read, len(chunk))
        return chunk


def test_an_over_long_line_is_skipped_unread_and_the_next_lines_still_run():
    big = b'{"id": "big", "prompt": "' + b"x" * 5_000_000 + b'"}'
    stream = CountingStream(b'{"prompt": "ab"}\n' + big + b'\n{"id": "after", "prompt": "cd"}\n')
    lines = list(read_lines(stream, max_line_bytes=1000))
    assert lines[0] == '{"prompt": "ab"}' and lines[2] == '{"id": "after", "prompt": "cd"}'
    assert lines[1] == OversizedLine(1000)
    assert stream.largest_read <= 2**20  # never the whole 5 MB line at once
    summary, records = _run(lines)
    by_id = {r["id"]: r for r in records}
    assert by_id["line-2"]["error"]["type"] == "line_too_long" and "1,000 bytes" in by_id["line-2"]["error"]["message"]
    assert by_id["line-1"]["error"] is None and by_id["after"]["error"] is None
    assert summary.exit_code == EXIT_SOME_FAILED


def test_an_endless_line_gives_its_error_before_its_end_is_found():
    """`generate /dev/zero` (or `< /dev/zero`): no newline ever comes, memory must stay bounded."""
    class Zeros(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, buffer):
            buffer[:] = bytes(len(buffer))
            return len(buffer)

    lines = read_lines(io.BufferedReader(Zeros()), max_line_bytes=4096)
    assert next(lines) == OversizedLine(4096)


def test_a_line_at_the_cap_is_read_whole_with_or_without_a_bom():
    line = b'{"prompt": "' + b"y" * 100 + b'"}'
    for data in (line + b"\n" + line, b"\xef\xbb\xbf" + line + b"\n" + line + b"\n"):
        assert list(read_lines(io.BytesIO(data), max_line_bytes=len(line))) == [line.decode()] * 2
    assert list(read_lines(io.BytesIO(line + b"x\n"), max_line_bytes=len(line))) == [OversizedLine(len(line))]


def test_the_default_cap_grows_with_max_model_len_and_is_at_least_a_mib():
    assert default_max_line_bytes(16) == 2**20
    assert default_max_line_bytes(131072) > 64 * 131072


# ----------------------------------------------------------------------------- a panicking tokenizer
class PanicException(BaseException):
    """Stands in for pyo3_runtime.PanicException (a BaseException, by name)."""


class PanickingTokenizer(FakeTokenizer):
    def encode(self, text, add_special_tokens=True):
        if "aaaa" in text:
            raise PanicException("Onig: Regex search error: retry-limit-in-match over")
        return super().encode(text, add_special_tokens)


def test_a_tokenizer_panic_or_memory_error_is_that_lines_error_only():
    engine = FakeEngine()
    engine.tokenizer = PanickingTokenizer()
    summary, records = _run([{"id": "ok", "prompt": "ab"}, {"id": "panic", "prompt": "aaaab"},
                             {"id": "chat", "messages": [{"role": "user", "content": "aaaa"}]},
                             {"id": "ok2", "prompt": "cd"}], engine)
    by_id = {r["id"]: r for r in records}
    assert by_id["ok"]["error"] is None and by_id["ok2"]["error"] is None
    assert "PanicException" in by_id["panic"]["error"]["message"]
    assert "PanicException" in by_id["chat"]["error"]["message"]
    assert summary.exit_code == EXIT_SOME_FAILED


def test_ctrl_c_inside_a_line_is_still_ctrl_c():
    class Interrupting(FakeTokenizer):
        def encode(self, text, add_special_tokens=True):
            raise KeyboardInterrupt

    engine = FakeEngine()
    engine.tokenizer = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        _run([{"prompt": "ab"}], engine)


def test_the_real_tokenizer_turns_a_rust_panic_into_a_value_error():
    from tokenizers import Regex
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from offline_paged.models.tokenizer import Tokenizer

    backend = Backend(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(a|aa)+$"), "isolated")  # backtracks
    tokenizer = Tokenizer(backend, frozenset(), None)
    assert tokenizer.encode("a") == [0]
    with pytest.raises(ValueError, match="the tokenizer failed on this text .Onig"):
        tokenizer.encode("a" * 64 + "b")


# ----------------------------------------------------------------------------- resume
def _state_of(records):
    """What open_output's scan would hand the job for these records."""
    stream = io.BytesIO()
    writer = JsonlWriter(stream)
    for record in records:
        writer.write(record)
    return stream.getvalue()


def test_every_record_carries_a_request_hash_and_an_edited_line_stops_the_resume(tmp_path):
    lines = [{"id": "a", "prompt": "ab"}, {"prompt": "cd"}, {"id": "bad", "prompt": ""}]
    out = tmp_path / "out.jsonl"
    _, records = _run(lines)
    assert all(isinstance(r["request_hash"], str) and len(r["request_hash"]) == 16 for r in records)
    out.write_bytes(_state_of(records))
    state = scan_and_repair(out)
    resume = dict(done_keys=state.done_keys, done_hashes=state.hashes, done_error_keys=state.error_keys)
    summary, again = _run(lines, **resume)  # the same input: everything skipped
    assert again == [] and summary.num_skipped == 3 and summary.num_failed_before == 1
    with pytest.raises(InputChangedError, match=r"line 2 \(id 'line-2'\)"):
        _run([lines[0], {"prompt": "edited"}, lines[2]], **resume)
    with pytest.raises(InputChangedError, match="line 2"):  # a line inserted shifts the line-N ids after it
        _run([lines[0], {"prompt": "new"}] + lines[1:], **resume)
    with pytest.raises(InputChangedError):  # another job-wide default is another request
        _run(lines, defaults={"max_tokens": 3}, **resume)


def test_the_exit_code_counts_only_the_current_inputs_failures():
    done_error_keys = {"gone"}  # an error record of a line no longer in the input
    summary, _ = _run([{"id": "a", "prompt": "ab"}], done_keys={"gone"}, done_error_keys=done_error_keys)
    assert summary.num_failed_before == 0 and summary.exit_code == EXIT_OK


def test_records_without_a_hash_are_still_resumed():
    summary, records = _run([{"id": "a", "prompt": "ab"}], done_keys={"a"}, done_hashes={})
    assert records == [] and summary.num_skipped == 1


def test_only_output_records_count_as_done_never_input_lines(tmp_path):
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "a", "prompt": "ab"}) + "\n" +
                   json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x"}}) + "\n")
    with pytest.raises(ValueError, match="not a job output record"):
        open_output(job, resume=True)
    _, records = _run([{"id": "a", "prompt": "ab"}, {"id": "bad", "prompt": ""},
                       {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
                       {"custom_id": "d", "method": "GET", "url": "/v1/completions", "body": {}}])
    assert len(records) == 4 and all(is_output_record(r) for r in records)
    assert not is_output_record({"id": "a", "prompt": "ab", "error": None})


# ----------------------------------------------------------------------------- DP losses, costs
class LosingEngine(FakeEngine):
    """Hands back request "lost" as a data-parallel coordinator does when its workers died."""

    def step(self):
        outputs = super().step()
        if "lost" in self._requests:
            del self._requests["lost"]
            outputs.append(RequestError("lost", "2 data-parallel workers died", unfinished=True))
        return outputs


def test_a_request_lost_with_its_workers_is_not_written_and_a_rerun_runs_it():
    lines = [{"id": "ok", "prompt": "ab"}, {"id": "lost", "prompt": "cd"}]
    summary, records = _run(lines, LosingEngine())
    assert [r["id"] for r in records] == ["ok"]
    assert summary.num_unfinished == 1 and summary.exit_code == EXIT_INCOMPLETE
    summary, records = _run(lines, done_keys={"ok"})
    assert [r["id"] for r in records] == ["lost"] and summary.exit_code == EXIT_OK


def test_an_error_message_is_cut_however_much_the_line_quotes():
    _, (record,) = _run([{"id": "x", "prompt": "ab", "k" * 5_000_000: 1}])
    assert record["error"]["type"] == "invalid_request"
    assert len(record["error"]["message"]) <= MAX_ERROR_MESSAGE_CHARS + 3


def test_output_amplification_is_refused_and_max_tokens_counts_up_to_max_model_len():
    summary, records = _run([{"id": "amp", "prompt": "ab", "n": 256, "max_tokens": 500, "logprobs": 20},
                             {"id": "long", "prompt": "ab", "max_tokens": 10**30, "logprobs": 20}],
                            FakeEngine(max_model_len=1000))
    by_id = {r["id"]: r for r in records}
    assert "over the cap" in by_id["amp"]["error"]["message"]
    assert by_id["long"]["error"] is None  # 10**30 tokens asked, at most 1000 can come
    assert is_error(by_id["amp"]) and record_key(by_id["amp"]) == "amp"


def test_skipping_an_endless_line_ends_when_the_job_is_asked_to_stop():
    class Zeros(io.RawIOBase):
        def __init__(self):
            self.num_reads = 0

        def readable(self):
            return True

        def readinto(self, buffer):
            self.num_reads += 1
            buffer[:] = bytes(len(buffer))
            return len(buffer)

    raw = Zeros()
    lines = read_lines(io.BufferedReader(raw), max_line_bytes=4096, should_stop=lambda: raw.num_reads > 50)
    assert next(lines) == OversizedLine(4096)
    assert next(lines, "ended") == "ended"  # it used to read /dev/zero for ever after Ctrl-C


def test_input_that_ends_because_the_job_was_stopped_counts_as_interrupted():
    from offline_paged.job.job_runner import EXIT_INTERRUPTED

    stopped = []

    def lines():
        yield json.dumps({"prompt": "ab"})
        stopped.append(True)  # Ctrl-C while the reader skipped an endless line: it ends early

    summary = JobRunner(FakeEngine(), JsonlWriter(io.BytesIO()), should_stop=lambda: bool(stopped)).run(lines())
    assert summary.exit_code == EXIT_INTERRUPTED
