"""Fuzzing single job lines through the real job loop and a tiny real engine: whatever a line holds
(any JSON value in any field, lone surrogates, huge numbers, bytes that are not UTF-8), it yields
exactly one record, the record is valid JSON, and the job goes on to the next line."""
import io
import json

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from offline_paged.core.sampling_params import FIELD_NAMES
from offline_paged.job.job_file import JsonlWriter
from offline_paged.job.job_input import read_lines
from offline_paged.job.job_output import is_error
from offline_paged.job.job_runner import JobRunner
from tiny_engine import tiny_engine

KEYS = FIELD_NAMES + ("id", "prompt", "messages", "prompt_token_ids", "custom_id", "method", "url",
                      "body", "role", "content", "type", "text", "max_completion_tokens",
                      "top_logprobs", "echo", "stream", "model", "context", "continuation")
GOOD = json.dumps({"id": "the-next-line", "prompt": "ok", "max_tokens": 2}).encode()

unicode_text = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)
numbers = (st.integers() | st.floats() |
           st.sampled_from([0, 1, -1, 2, 20, 21, 259, 260, 49152, 2**63, 2**64, 10**12, 10**400,
                            -(10**400), 10**4299, 1e308, 0.5]))
leaves = st.none() | st.booleans() | numbers | unicode_text | st.sampled_from(KEYS) | \
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "POST", "user", "text"])
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) |
                      st.dictionaries(st.sampled_from(KEYS) | unicode_text, inner, max_size=4),
                      max_leaves=12)
objects = st.dictionaries(st.sampled_from(KEYS) | unicode_text, values, max_size=7)
prompted = st.fixed_dictionaries(  # a prompt with sampling fields: more lines reach the engine
    {"prompt": unicode_text}, optional={k: numbers | st.booleans() | values for k in FIELD_NAMES})
small = (st.none() | st.booleans() | st.integers(-1, 30) | st.floats(0, 2) |
         st.lists(st.integers(0, 300), max_size=3) | st.text(max_size=3))
scoring = st.fixed_dictionaries({"context": unicode_text, "continuation": unicode_text},
                                optional={"id": unicode_text, "max_tokens": numbers})
plausible = st.builds(  # near-valid requests (a few small fields), so many lines run in the engine
    lambda prompt, fields: {"prompt": prompt, **fields, "max_tokens": 3},
    st.text(min_size=1, max_size=8), st.dictionaries(st.sampled_from(FIELD_NAMES), small, max_size=2))
deep = st.integers(1, 30_000).map(lambda depth: b"[" * depth + b"]" * depth)
raw_lines = st.one_of(
    (objects | prompted | plausible | scoring | values).map(lambda v: json.dumps(v).encode()),  # surrogates as \\ud800-style escapes
    deep,
    st.binary(max_size=64),
)


def _one_line_job(engine, line: bytes) -> list[dict]:
    stream = io.BytesIO()
    data = line.replace(b"\n", b" ") + b"\n" + GOOD + b"\n"
    summary = JobRunner(engine, JsonlWriter(stream)).run(read_lines(io.BytesIO(data)))
    records = [json.loads(x) for x in stream.getvalue().decode("utf-8").split("\n")[:-1]]
    assert summary.num_requests == len(records)
    return records


_ENGINE = []


def _engine():
    if not _ENGINE:  # one engine for every example: each job leaves it empty
        _ENGINE.append(tiny_engine(max_model_len=24, max_num_seqs=8))
    return _ENGINE[0]


@settings(max_examples=3 * settings.default.max_examples,  # ~1 s in the ci profile
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.data_too_large])
@given(line=raw_lines)
def test_any_single_line_yields_one_record_and_the_job_goes_on(line):
    engine = _engine()
    records = _one_line_job(engine, line)
    blank = not line.replace(b"\n", b" ").removeprefix(b"\xef\xbb\xbf").strip(b" \t\r")
    assert len(records) == (1 if blank else 2)
    assert not engine.has_unfinished_requests()
    nxt = [r for r in records if r.get("id") == "the-next-line"]
    assert len(nxt) == 1 and not is_error(nxt[0])
    event("the line ran" if sum(not is_error(r) for r in records) == 2 else "an error record")
