"""Job input: one JSONL line -> a JobRequest to run, or a LineError to record.

Formats are detected per line:
- native: {"id"?, "prompt" | "messages" | "prompt_token_ids", <SamplingParams fields>...};
  a line without "id" gets "line-<N>" (N = 1-based line number).
- scoring: {"id"?, "context", "continuation"}: the log-likelihood of the continuation given the
  context and whether greedy decoding would produce it (lm-evaluation-harness's loglikelihood).
- OpenAI Batch API: {"custom_id", "method": "POST", "url", "body"} with url "/v1/completions",
  "/v1/chat/completions" or "/v1/embeddings"; the custom_id is the request id.
Blank lines are ignored. Sampling fields missing from a line come from the job's defaults; a native
line without max_tokens gets SamplingParams' 16 (vLLM's default), while an OpenAI line without
max_tokens / max_completion_tokens (and no job default) generates to the end of the context, as OpenAI
and vLLM's OpenAI server do. OpenAI's logit_bias ({"token id": -100..100}) maps onto SamplingParams';
response_format {"type": "text"} is the default; "json_schema" and "json_object" constrain the output
(structured output, like vLLM's guided_* fields).
Lines are split on b"\n" only (a bare CR inside a line is part of that line), and a UTF-8 byte
order mark before the first line is skipped (`read_lines`). Whatever a line holds, `parse_line`
returns one JobRequest or one LineError: it never raises.
"""
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.request_processor import ids_in_range

_BOM = b"\xef\xbb\xbf"
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*("(?:[^"\\]|\\.){1,512}")')

NATIVE = "native"
SCORE = "score"
COMPLETIONS = "completions"
CHAT = "chat"
EMBEDDINGS = "embeddings"
URLS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "/v1/embeddings": EMBEDDINGS}
# max_tokens of an OpenAI line that sets none: more than any context, so the context length ends it
UNTIL_CONTEXT_END = 2**31 - 1
_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_OPENAI_KEYS = ("custom_id", "method", "url", "body")
# vLLM's extra body fields, accepted in OpenAI bodies under their SamplingParams names
_VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                "stop_token_ids", "skip_special_tokens", "use_beam_search", "prompt_logprobs")
_COMMON_BODY = ("max_tokens", "temperature", "top_p", "n", "stop", "seed",
                "presence_penalty", "frequency_penalty", "logit_bias") + _VLLM_EXTRAS
# Structured output: vLLM's extra fields (native lines and OpenAI bodies) -> StructuredOutputsParams fields
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_BODY = ("response_format", "structured_outputs", *_GUIDED_FIELDS)
_IGNORED_BODY = ("model", "user", "metadata", "store", "stream_options", "parallel_tool_calls")
# OpenAI fields we know and cannot honour: refused as "not supported", never as "unknown"
_UNSUPPORTED_BODY = ("tools", "tool_choice", "functions", "function_call",
                     "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
                     "service_tier")


@dataclass(slots=True, frozen=True)
class JobRequest:
    """One runnable request. Exactly one of prompt / messages / prompt_token_ids is set.

    api: "native", "score" (context + continuation), or "completions" / "chat" for OpenAI batch
    lines (decides the output shape). A scoring request carries the context as `prompt`; the
    job loop tokenizes it and sets `prompt_token_ids` and `num_scored_tokens` (the continuation's).
    """

    line_number: int
    request_id: str
    api: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    continuation: str | None = None
    num_scored_tokens: int = 0
    model: str | None = None  # an OpenAI body's "model", echoed in its response
    echo: bool = False  # OpenAI completions: the prompt (and its logprobs) lead the choice
    generate: bool = True  # False for OpenAI max_tokens 0: one token runs, none is returned
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables of a chat line
    inputs: tuple[str | tuple[int, ...], ...] | None = None  # an embeddings line's texts / token-id lists

    @property
    def key(self) -> str:
        """What marks this line done in the output file (see LineError.key)."""
        return self.request_id


@dataclass(slots=True, frozen=True)
class LineError:
    """A line that cannot run. `openai` picks the output shape; `status_code` is for that shape."""

    line_number: int
    request_id: str
    error_type: str  # invalid_json | invalid_request | unsupported_url | duplicate_id | rejected | line_too_long
    message: str
    openai: bool = False
    status_code: int = 400

    @property
    def key(self) -> str:
        """A duplicate shares its id with an earlier line, so it is keyed by its line instead."""
        if self.error_type == "duplicate_id":
            return duplicate_key(self.line_number)
        return self.request_id


class _BadLine(ValueError):
    def __init__(self, error_type: str, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.status_code = status_code


def default_id(line_number: int) -> str:
    return f"line-{line_number}"


def duplicate_key(line_number: int) -> str:
    return f"duplicate@line-{line_number}"


@dataclass(slots=True, frozen=True)
class OversizedLine:
    """A line longer than the reader's cap. Its bytes are skipped, never held: the reader yields
    this as soon as the line passes the cap, before it has found the line's end."""

    max_line_bytes: int

    def error(self, line_number: int) -> "LineError":
        return LineError(line_number, default_id(line_number), "line_too_long",
                         f"line {line_number}: longer than the limit of {self.max_line_bytes:,} bytes "
                         "(--max-line-bytes); it was skipped unread")


def default_max_line_bytes(max_model_len: int) -> int:
    """The cap on one input line: room for max_model_len tokens written out in JSON at their most
    verbose (escaped characters, token ids with separators), and never under 1 MiB."""
    return max(2**20, 64 * max_model_len + 2**16)


def read_lines(stream, max_line_bytes: int | None = None,
               should_stop: Callable[[], bool] = lambda: False) -> Iterator[str | OversizedLine]:
    """The lines of a binary stream, split on b"\n" only, as text.

    Bytes that are not UTF-8 are kept as lone surrogates (surrogateescape), which parse_line
    reports as an error for that line alone; a BOM before the first line is dropped. A line over
    `max_line_bytes` (newline excluded) is yielded as an OversizedLine and its bytes are read and
    dropped in bounded chunks, so the reader never holds more than one bounded line; skipping ends
    the input early once `should_stop()` (an endless line, `< /dev/zero`, must not outlive Ctrl-C).
    """
    limit = -1 if max_line_bytes is None else max_line_bytes + len(_BOM) + 1
    first = True
    while raw := stream.readline(limit):
        if first and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        first = False
        body = raw.removesuffix(b"\n")
        if max_line_bytes is not None and len(body) > max_line_bytes:
            yield OversizedLine(max_line_bytes)
            if not _skip_rest(stream, raw, should_stop):
                return
            continue
        yield body.decode("utf-8", errors="surrogateescape")


def _skip_rest(stream, read: bytes, should_stop: Callable[[], bool]) -> bool:
    """Drop the rest of a line; False when stopped before its end."""
    while read and not read.endswith(b"\n"):
        if should_stop():
            return False
        read = stream.readline(2**20)
    return True


def parse_line(line_number: int, text: str, defaults: Mapping[str, Any]) -> JobRequest | LineError:
    """Parse one non-blank line; never raises for bad input (returns a LineError instead)."""
    try:
        return _parse(line_number, text, defaults)
    except RecursionError:  # parsing or validating values nested thousands of levels deep
        return _json_error(line_number, text, "JSON nested too deeply")


def _parse(line_number: int, text: str, defaults: Mapping[str, Any]) -> JobRequest | LineError:
    if not _is_unicode(text):
        return _json_error(line_number, text, "not valid UTF-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        reason = exc.msg.removesuffix(" at")  # "Invalid control character at"
        return _json_error(line_number, text, f"invalid JSON ({reason} at column {exc.colno})")
    except ValueError:  # json's only other ValueError: an integer past Python's digit limit
        return _json_error(line_number, text, "invalid JSON (an integer with too many digits)")
    if not isinstance(obj, dict):
        return LineError(line_number, default_id(line_number), "invalid_request",
                         f"line {line_number}: expected a JSON object, got {type(obj).__name__}")
    is_openai = any(k in obj for k in _OPENAI_KEYS)
    request_id = _openai_id(obj, line_number) if is_openai else _native_id(obj, line_number)
    try:
        # A lone surrogate can only come from a \u escape (the text itself is valid Unicode): lines without
        # one skip the re-encoding (about a third of parsing a 560-token prompt_token_ids line).
        if "\\u" in text and not _is_unicode(json.dumps(obj, ensure_ascii=False)):
            raise ValueError("a string holds a lone surrogate (\\ud800-\\udfff escape), "
                             "which is not valid Unicode")
        if is_openai:
            return _parse_openai(line_number, obj, defaults)
        return _parse_native(line_number, request_id, obj, defaults)
    except _BadLine as exc:
        return LineError(line_number, request_id, exc.error_type, f"line {line_number}: {exc}",
                         is_openai, exc.status_code)
    except (ValueError, TypeError, OverflowError) as exc:
        return LineError(line_number, request_id, "invalid_request", f"line {line_number}: {exc}",
                         is_openai)


def _json_error(line_number: int, text: str, reason: str) -> LineError:
    """A line that is not JSON. One that looks like an OpenAI batch line (it names a custom_id)
    gets the OpenAI shape and, when it can be read, its own custom_id."""
    found = _CUSTOM_ID.search(text) if '"custom_id"' in text else None
    request_id = default_id(line_number)
    if found:
        try:
            value = json.loads(found.group(1))
            request_id = _printable_id(value) if value else request_id
        except ValueError:
            pass
    return LineError(line_number, request_id, "invalid_json", f"line {line_number}: {reason}",
                     openai='"custom_id"' in text)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable_id(value: str) -> str:
    """An id that can be written as UTF-8 (a lone surrogate becomes its escape, e.g. \\ud800)."""
    return value if _is_unicode(value) else value.encode("utf-8", "backslashreplace").decode()


def _native_id(obj: dict, line_number: int) -> str:
    value = obj.get("id")
    if isinstance(value, str) and value:
        return _printable_id(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return default_id(line_number)


def _openai_id(obj: dict, line_number: int) -> str:
    value = obj.get("custom_id")
    return _printable_id(value) if isinstance(value, str) and value else default_id(line_number)


def _parse_native(line_number: int, request_id: str, obj: dict,
                  defaults: Mapping[str, Any]) -> JobRequest:
    if "id" in obj and not (
        (isinstance(obj["id"], str) and obj["id"]) or
        (isinstance(obj["id"], int) and not isinstance(obj["id"], bool))
    ):
        raise ValueError(f"id must be a non-empty string or an integer, got {obj['id']!r}")
    if "context" in obj or "continuation" in obj:
        return _score_request(line_number, request_id, obj)
    given = [k for k in _PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError(f"a line needs exactly one of {', '.join(_PROMPT_KEYS)} "
                         f"(got {', '.join(given) or 'none'})")
    fields = _structured_fields({k: v for k, v in obj.items() if k not in ("id", given[0], "chat_template_kwargs")})
    params = SamplingParams.from_dict({**defaults, **fields})
    kwargs = _template_kwargs(obj, given[0])
    return JobRequest(line_number, request_id, NATIVE, params, **_prompt(given[0], obj[given[0]]),
                      chat_template_kwargs=kwargs)


def _template_kwargs(obj: dict, prompt_kind: str = "messages") -> dict[str, Any] | None:
    """A chat line's `chat_template_kwargs` (vLLM's name, e.g. {"enable_thinking": false}): an object,
    only next to messages."""
    value = obj.get("chat_template_kwargs")
    if value is None:
        return None
    if prompt_kind != "messages":
        raise ValueError("chat_template_kwargs applies to messages only")
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"chat_template_kwargs must be an object, got {str(value)[:60]!r}")
    return value


def _score_request(line_number: int, request_id: str, obj: dict) -> JobRequest:
    extra = sorted(set(obj) - {"id", "context", "continuation"})
    if extra:
        raise ValueError(f"a scoring line takes only id, context and continuation "
                         f"(got {', '.join(extra)})")
    for name in ("context", "continuation"):
        if not isinstance(obj.get(name), str) or not obj[name]:
            raise ValueError(f"{name} must be a non-empty string, got {obj.get(name)!r:.60}")
    # prompt_logprobs=1: each position's own log-probability and the most likely token's;
    # one token is generated and dropped (the engine needs max_tokens >= 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    return JobRequest(line_number, request_id, SCORE, params, prompt=obj["context"],
                      continuation=obj["continuation"])


def score_tokens(encode, context: str, continuation: str) -> tuple[list[int], int]:
    """Token ids of context + continuation and how many of them are the continuation's, split as
    lm-evaluation-harness does: trailing spaces of the context move to the continuation, the
    whole text is encoded once, and the continuation is what follows the context's own tokens."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces and num_spaces < len(context):
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = list(encode(context + continuation))
    num_context = len(encode(context))
    if num_context == 0:  # position 0 has no log-probability to score
        raise ValueError("the context encodes to no tokens")
    if num_context >= len(whole):
        raise ValueError("the continuation adds no tokens to the context")
    return whole, len(whole) - num_context


def _prompt(kind: str, value: Any) -> dict[str, Any]:
    if kind == "prompt":
        return {"prompt": _check_prompt(value)}
    if kind == "messages":
        return {"messages": _check_messages(value)}
    return {"prompt_token_ids": _check_token_ids(value)}


def _check_prompt(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"prompt must be a non-empty string, got {value!r:.60}")
    return value


def _check_token_ids(value: Any) -> list[int]:
    # Any non-negative ints here (the engine checks them against its vocabulary); ids_in_range's fast path
    # takes json's plain ints in C-level passes, and bools and floats fail its per-token test.
    if not isinstance(value, list) or not value or not ids_in_range(value, math.inf):
        raise ValueError("prompt_token_ids must be a non-empty list of non-negative integers")
    return value


def _check_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    return [_check_message(i, m) for i, m in enumerate(value)]


def _check_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{index}] must be an object with a string role")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text parts can be rendered
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"messages[{index}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string")
    return {**message, "content": content}


def _parse_openai(line_number: int, obj: dict, defaults: Mapping[str, Any]) -> JobRequest:
    unknown = sorted(set(obj) - set(_OPENAI_KEYS))
    if unknown:
        raise ValueError(f"unknown field(s) in a batch line: {', '.join(unknown)}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if obj.get("method") != "POST":
        raise _BadLine("invalid_request", f"method must be \"POST\", got {obj.get('method')!r}", 405)
    api = URLS.get(obj.get("url"))
    if api is None:
        raise _BadLine("unsupported_url", f"unsupported url {obj.get('url')!r} "
                       f"(supported: {', '.join(URLS)})", 404)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    if api == CHAT:
        return _chat_request(line_number, custom_id, body, defaults)
    if api == EMBEDDINGS:
        return _embeddings_request(line_number, custom_id, body)
    return _completion_request(line_number, custom_id, body, defaults)


def _openai_params(defaults: Mapping[str, Any], fields: dict[str, Any]) -> SamplingParams:
    """No max_tokens anywhere: generate to the end of the context (OpenAI's rule, not vLLM's 16)."""
    return SamplingParams.from_dict({"max_tokens": UNTIL_CONTEXT_END, **defaults, **fields})


def _completion_request(line_number: int, custom_id: str, body: dict,
                        defaults: Mapping[str, Any]) -> JobRequest:
    _reject_unsupported(body, suffix=None)
    _reject_unknown(body, _COMMON_BODY + _IGNORED_BODY + _STRUCTURED_BODY +
                    ("prompt", "logprobs", "best_of", "echo", "stream", "suffix"))
    fields = _common_fields(body)
    if body.get("logprobs") is not None:
        fields["logprobs"] = body["logprobs"]
    if "best_of" in body:
        fields["best_of"] = body["best_of"]
    echo = _echo(body, fields)
    generate = not _is_zero(fields.get("max_tokens"))
    if not generate:  # scoring the prompt only: one token runs, the output drops it
        fields["max_tokens"] = 1
    params = _openai_params(defaults, fields)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (
            isinstance(prompt[0], str) or isinstance(prompt[0], list)):
        prompt = prompt[0]  # one prompt in a batch of one (text, or token ids as lm-eval sends)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ValueError(f"prompt holds {len(prompt)} prompts; a batch line takes one prompt (a string or "
                         "one token-id list): put each prompt on its own line with its own custom_id")
    kind = {"prompt_token_ids": _check_token_ids(prompt)} if isinstance(prompt, list) else \
        {"prompt": _check_prompt(prompt)}
    return JobRequest(line_number, custom_id, COMPLETIONS, params, **kind,
                      model=_model(body), echo=echo, generate=generate)


def _echo(body: dict, fields: dict[str, Any]) -> bool:
    """echo: the prompt leads the choice; with logprobs, its tokens' log-probabilities too (the
    first token has none). max_tokens 0 is allowed only with echo (there is nothing else)."""
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ValueError(f"echo must be true or false, got {echo!r:.60}")
    if _is_zero(fields.get("max_tokens")) and not echo:
        raise ValueError("max_tokens 0 needs echo: true (there would be nothing to return)")
    if echo and fields.get("logprobs") is not None:
        fields.setdefault("prompt_logprobs", fields["logprobs"])
    return echo


def _is_zero(value: Any) -> bool:
    return type(value) is int and value == 0  # not False, not 0.0


def _model(body: dict) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None


def _chat_request(line_number: int, custom_id: str, body: dict,
                  defaults: Mapping[str, Any]) -> JobRequest:
    _reject_unsupported(body)
    _reject_unknown(body, _COMMON_BODY + _IGNORED_BODY + _STRUCTURED_BODY + ("messages", "max_completion_tokens",
                    "logprobs", "top_logprobs", "stream", "chat_template_kwargs"))
    fields = _common_fields(body)
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    if body.get("logprobs") not in (None, False, True):
        raise ValueError(f"logprobs must be true or false for chat, got {body['logprobs']!r:.60}")
    if body.get("logprobs"):
        fields["logprobs"] = body.get("top_logprobs") or 0
    params = _openai_params(defaults, fields)
    return JobRequest(line_number, custom_id, CHAT, params,
                      messages=_check_messages(body.get("messages")), model=_model(body),
                      chat_template_kwargs=_template_kwargs(body))


def _common_fields(body: dict) -> dict[str, Any]:
    # OpenAI sends null for "not set"; null then means "job default"
    fields = {k: body[k] for k in _COMMON_BODY if body.get(k) is not None}
    bias = fields.get("logit_bias")
    if isinstance(bias, dict) and any(isinstance(v, (int, float)) and not -100 <= v <= 100 for v in bias.values()):
        raise ValueError("logit_bias values must be between -100 and 100 (OpenAI's range)")
    if bias == {}:
        del fields["logit_bias"]
    structured = _structured_fields({k: body[k] for k in _STRUCTURED_BODY if body.get(k) is not None})
    return fields | structured


def _structured_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with vLLM's guided_* fields and OpenAI's response_format folded into one
    "structured_outputs" object (SamplingParams validates it); two ways of saying it at once is an error."""
    guided = {_GUIDED_FIELDS[k]: fields.pop(k) for k in list(fields) if k in _GUIDED_FIELDS}
    response = _response_format(fields.pop("response_format", None))
    given = [name for name, value in (("structured_outputs", fields.get("structured_outputs")),
                                      ("guided_*", guided or None), ("response_format", response)) if value]
    if len(given) > 1:
        raise ValueError(f"give one of {' / '.join(given)} (they all constrain the output)")
    if guided or response:
        fields["structured_outputs"] = guided or response
    return fields


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format -> StructuredOutputsParams fields (None: plain text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return {"json": spec["schema"]}
    raise ValueError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r:.60}')


def _embeddings_request(line_number: int, custom_id: str, body: dict) -> JobRequest:
    """OpenAI's embeddings body: input is a string, a list of strings, a token-id list, or a list of
    them; encoding_format "float" only; dimensions is not supported."""
    _reject_unknown(body, ("input", "model", "user", "encoding_format", "dimensions"))
    if body.get("encoding_format", "float") not in ("float", None):
        raise ValueError(f"encoding_format {body['encoding_format']!r:.40} is not supported (only \"float\")")
    if body.get("dimensions") is not None:
        raise ValueError("dimensions is not supported (embeddings keep the model's hidden size)")
    value = body.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("input must be a non-empty string, a list of strings, or token-id lists")
    inputs = tuple(_check_prompt(v) if isinstance(v, str) else tuple(_check_token_ids(v)) for v in value)
    return JobRequest(line_number, custom_id, EMBEDDINGS, SamplingParams(max_tokens=1), inputs=inputs,
                      model=_model(body))


def _reject_unknown(body: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"unknown body field(s): {', '.join(unknown)}")


def _reject_unsupported(body: dict, **harmless: Any) -> None:
    for name in _UNSUPPORTED_BODY:
        if body.get(name) is not None:
            raise ValueError(f"{name} is not supported")
    if body.get("stream"):
        raise ValueError("stream is not supported in a batch job")
    for name, value in harmless.items():
        if body.get(name, value) != value:
            raise ValueError(f"{name} is not supported")
