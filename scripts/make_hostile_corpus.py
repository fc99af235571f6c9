"""Write tests/data/hostile_jobs.jsonl: one job file holding every kind of input line that has
crashed, hung or blown up the job before (issues 15 and 29), between good lines.

Run `python scripts/make_hostile_corpus.py` after changing it and commit both; a test checks that
the committed file is exactly what this script writes, so it is never edited by hand.
The file is bytes on purpose: a BOM, bare CRs and bytes that are not UTF-8 are part of the corpus.
Each non-blank line must give exactly one output record; ids say what each line tries.
"""
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "hostile_jobs.jsonl"
DEEP = 10_000
MAX_LINE_BYTES = 250_000  # the test runs the corpus with --max-line-bytes 250000


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate becomes a \\ud800-style escape


def _native(name: str, **fields) -> bytes:
    return _line({"id": name, "prompt": "Hi", "max_tokens": 2, **fields})


def _openai(name: str, url: str, **body) -> bytes:
    return _line({"custom_id": name, "method": "POST", "url": url, "body": body})


def _good(name: str) -> bytes:
    return _native(name, temperature=0)


def hostile_lines() -> list[bytes]:
    nested = b"[" * DEEP + b"]" * DEEP
    huge = b"1" + b"0" * 400
    return [
        b"\xef\xbb\xbf" + _good("good-after-bom"),
        b'{"id": "deep-object", "prompt": "Hi", "x": ' + nested + b"}",
        b'{"id": "deep-stop", "prompt": "Hi", "stop": ' + nested + b"}",
        b"{" * DEEP,
        b'{"id": "seed-4301-digits", "prompt": "Hi", "seed": ' + b"9" * 4301 + b"}",
        b'{"id": "n-minus-4301-digits", "prompt": "Hi", "n": -' + b"9" * 4301 + b"}",
        b'{"id": "temperature-1e400", "prompt": "Hi", "temperature": ' + huge + b"}",
        b'{"id": "top-p-1e400", "prompt": "Hi", "top_p": ' + huge + b"}",
        b'{"id": "penalty-1e400", "prompt": "Hi", "presence_penalty": -' + huge + b"}",
        b'{"id": "nan-temperature", "prompt": "Hi", "temperature": NaN}',
        b'{"id": "inf-top-p", "prompt": "Hi", "top_p": Infinity}',
        _good("good-1"),
        _line({"id": "\ud800", "prompt": "Hi"}),
        _line({"id": "surrogate\udfff-in-id", "prompt": "Hi"}),
        _line({"custom_id": "\udc00", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "Hi"}}),
        _native("surrogate-prompt", prompt="a\ud800b"),
        _line({"id": "surrogate-message", "messages": [{"role": "user", "content": "\udbff"}]}),
        _line({"id": "surrogate-role", "messages": [{"role": "\ud800", "content": "Hi"}]}),
        _native("surrogate-stop", stop=["\ud800"]),
        _openai("surrogate-chat", "/v1/chat/completions",
                messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
        _native("stop-id-past-vocab", stop_token_ids=[49152], min_tokens=1),
        _native("stop-id-huge", stop_token_ids=[10**30], min_tokens=1),
        _line({"id": "prompt-id-past-vocab", "prompt_token_ids": [49152], "max_tokens": 2}),
        _native("n-1e12", n=10**12),
        _native("best-of-1e12", best_of=10**12),
        _native("n-float", n=1e300),
        _openai("openai-n-1e12", "/v1/completions", prompt="Hi", n=10**12),
        _native("logprobs-1e6", logprobs=10**6),
        _native("prompt-logprobs-1e6", prompt_logprobs=10**6),
        _openai("openai-logprobs-1e6", "/v1/completions", prompt="Hi", logprobs=10**6),
        _openai("openai-top-logprobs-1e6", "/v1/chat/completions",
                messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=10**6),
        _good("good-2"),
        b'{"id": "cr-inside-string", "prompt": "a\rb"}',
        b'{"id": "cr-between-tokens",\r"prompt": "Hi",\r"max_tokens": 2}',
        b"\r",
        b'{"id": "crlf-ending", "prompt": "Hi", "max_tokens": 2}\r',
        b'{"id": "not-utf8", "prompt": "\xff\xfe"}',
        b'{"id": "overlong-utf8", "prompt": "\xc0\xaf"}',
        b"\xef\xbb\xbf" + _good("bom-not-first"),
        b'{"id": "nul", "prompt": "a\x00b"}',
        b"\x00\x00\x00",
        b"   \t  ",
        _native("max-tokens-1e30", max_tokens=10**30, min_tokens=10**29),
        _native("top-k-1e30", top_k=10**30),
        _native("seed-negative", seed=-1),
        _native("stop-list-of-lists", stop=[["a"]] * 1000),
        _native("long-prompt", prompt="x" * 200_000),
        _line({"id": {"nested": [1, 2]}, "prompt": "Hi"}),
        _line({"id": "", "prompt": "Hi"}),
        _line({"id": "messages-not-list", "messages": {"role": "user"}}),
        _line({"id": "content-parts-bad", "messages": [{"role": "user", "content": [1, None]}]}),
        _line({"custom_id": "body-list", "method": "POST", "url": "/v1/completions", "body": []}),
        _line({"custom_id": ["x"], "method": "POST", "url": "/v1/completions", "body": {}}),
        _line({"id": "score-ok", "context": "The sky", "continuation": " is"}),
        _line({"id": "score-surrogate", "context": "a", "continuation": "\ud800"}),
        _line({"id": "score-nested", "context": "a", "continuation": [[["b"]]]}),
        _line({"id": "score-extra", "context": "a", "continuation": "b", "n": 10**12}),
        _openai("echo-ok", "/v1/completions", prompt="Hi", max_tokens=0, echo=True, logprobs=1),
        _openai("echo-logprobs-1e6", "/v1/completions", prompt="Hi", max_tokens=0, echo=True,
                logprobs=10**6),
        _openai("echo-not-bool", "/v1/completions", prompt="Hi", echo=[True] * 1000),
        _openai("tools", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                tools=[{"type": "function"}] * 100),
        b'{"custom_id": "broken-openai", "method": "POST", "url": "/v1/completions", "body": {',
        *round_two_lines(),
        _good("good-last"),
    ]


def round_two_lines() -> list[bytes]:
    """Issue 29: a line past the line cap (skipped unread), costs past their caps, a 5e-324
    temperature (greedy, as in vLLM, not NaN), an error that would quote 60 KB."""
    return [
        _native("line-over-cap", prompt="y" * (MAX_LINE_BYTES + 10_000)),
        _native("temperature-5e-324", temperature=5e-324),
        _native("stop-2000-strings", stop=[f"s{i}" for i in range(2000)]),
        _native("bad-words-5000", bad_words=[f"w{i}" for i in range(5000)]),
        _line({"id": "field-name-60k", "prompt": "Hi", "k" * 60_000: 1}),
        _openai("openai-field-name-60k", "/v1/completions", prompt="Hi", **{"k" * 60_000: 1}),
    ]


def build() -> bytes:
    return b"".join(line + b"\n" for line in hostile_lines())


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(build())
    print(f"wrote {OUT} ({len(hostile_lines())} lines)")


if __name__ == "__main__":
    main()
