"""Job output records: the native format, the OpenAI batch output shape, and error records.

Native success: {"id", "line", "text" (first sample's), "outputs": [{"index", "text", "token_ids",
"finish_reason" ("stop" | "length" | "eos" | "abort"), "stop_reason", "cumulative_logprob",
"logprobs"?}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
"cached_prompt_tokens"}, "prompt_logprobs"?, "error": null}.
Scoring success: {"id", "line", "loglikelihood", "is_greedy", "num_tokens", "usage", "error": null}
(lm-evaluation-harness's loglikelihood of the continuation, summed over its num_tokens tokens).
Native error: {"id", "line", "error": {"type", "message"}}.
OpenAI lines get {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}
where body is a completion / chat.completion object, or {"error": {...}} with a 4xx status (the
shape of OpenAI's output file; vLLM's run-batch instead writes its message to the top-level "error"
with no body). Ids carry a per-run token, so two runs never share a response id; "model" is the model
that ran (the job's served model name), never the body's; usage carries prompt_tokens_details.cached_tokens
(prompt tokens served by the prefix cache). An embeddings line gets OpenAI's {"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage"} body. Completions with echo lead with
the prompt (its first token has no log-probability);
chat top_logprobs hold exactly the top_logprobs asked for.
Log-probabilities are the raw model's (see sampling_params); -inf is written as -9999.0.
"""
import codecs
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from offline_paged.core.outputs import CompletionOutput, RequestOutput
from offline_paged.job.job_input import CHAT, NATIVE, SCORE, JobRequest, LineError, duplicate_key



@dataclass(frozen=True, slots=True)
class TokenStrings:
    """How a token shows in OpenAI log-probabilities: its decoded text, and its raw bytes (the
    byte-level vocabulary's, so half a UTF-8 character is that half, not the bytes of U+FFFD)."""

    text: Callable[[int], str]
    raw: Callable[[int], bytes]

    @classmethod
    def of(cls, tokenizer) -> "TokenStrings":
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        raw = getattr(tokenizer, "token_bytes", None) or (lambda token_id: text(token_id).encode("utf-8"))
        return cls(text, raw)


DecodeToken = TokenStrings  # what success_record / openai_record take to show tokens
_FLOOR_LOGPROB = -9999.0  # OpenAI's stand-in for a log-probability of -inf


def success_record(request: JobRequest, output: RequestOutput, model_name: str,
                   decode_token: DecodeToken, run_id: str = "") -> dict[str, Any]:
    """The output line of a request that ran; `run_id` makes OpenAI response ids unique per run."""
    if request.api == NATIVE:
        return native_record(request, output)
    if request.api == SCORE:
        return score_record(request, output)
    return openai_record(request, output, model_name, decode_token, run_id)


def error_record(error: LineError, run_id: str = "") -> dict[str, Any]:
    """The output line of a line that could not run."""
    if not error.openai:
        return {"id": error.request_id, "line": error.line_number,
                "error": {"type": error.error_type, "message": error.message}}
    body = {"error": {"message": error.message, "type": "invalid_request_error", "param": None,
                      "code": error.error_type}}
    return _openai_envelope(error.line_number, error.request_id, error.status_code, body, run_id)


def native_record(request: JobRequest, output: RequestOutput) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": request.request_id,
        "line": request.line_number,
        "text": output.outputs[0].text if output.outputs else "",
        "outputs": [_native_completion(c) for c in output.outputs],
        "usage": usage(output),
    }
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = _native_prompt_logprobs(output)
    record["error"] = None
    return record


def score_record(request: JobRequest, output: RequestOutput) -> dict[str, Any]:
    """loglikelihood: the continuation's summed log-probabilities; is_greedy: each of its tokens is
    the most likely one at its position (a tie counts as greedy)."""
    num_tokens = request.num_scored_tokens
    tokens = output.prompt_token_ids[-num_tokens:]
    tops = output.prompt_logprobs[-num_tokens:]
    return {
        "id": request.request_id,
        "line": request.line_number,
        "loglikelihood": _finite(sum(top[t] for t, top in zip(tokens, tops))),
        "is_greedy": all(top[t] >= max(top.values()) for t, top in zip(tokens, tops)),
        "num_tokens": num_tokens,
        "usage": usage(output),
        "error": None,
    }


def usage(output: RequestOutput) -> dict[str, int]:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "cached_prompt_tokens": output.num_cached_tokens}


def finish_reason(completion: CompletionOutput) -> str | None:
    return "eos" if completion.finished_by_eos else completion.finish_reason


def _native_completion(c: CompletionOutput) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": c.index, "text": c.text, "token_ids": list(c.token_ids),
        "finish_reason": finish_reason(c), "stop_reason": c.stop_reason,
        "cumulative_logprob": _finite(c.cumulative_logprob),
    }
    if c.logprobs is not None:
        record["logprobs"] = [_native_logprob(t, d) for t, d in zip(c.token_ids, c.logprobs)]
    return record


def _native_logprob(token_id: int, top: dict[int, float]) -> dict[str, Any]:
    return {"token_id": token_id, "logprob": _finite(top.get(token_id)),
            "top_logprobs": [[t, _finite(lp)] for t, lp in _ranked(top)]}


def _native_prompt_logprobs(output: RequestOutput) -> list[dict[str, Any] | None]:
    return [None if top is None else _native_logprob(t, top)
            for t, top in zip(output.prompt_token_ids, output.prompt_logprobs)]


def openai_record(request: JobRequest, output: RequestOutput, model_name: str,
                  decode_token: DecodeToken, run_id: str = "") -> dict[str, Any]:
    chat = request.api == CHAT
    if chat:
        choices = [_chat_choice(c, decode_token, request.params.logprobs) for c in output.outputs]
    else:
        choices = [_completion_choice(c, decode_token, request, output) for c in output.outputs]
    counts = usage(output)
    if not request.generate:
        counts["completion_tokens"], counts["total_tokens"] = 0, counts["prompt_tokens"]
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{_suffix(request.line_number, run_id)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {**{k: counts[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                  "prompt_tokens_details": {"cached_tokens": counts["cached_prompt_tokens"]}},
    }
    return _openai_envelope(request.line_number, request.request_id, 200, body, run_id)


def embedding_record(request: JobRequest, vectors: list, num_prompt_tokens: int, model_name: str,
                     run_id: str = "") -> dict[str, Any]:
    """The output line of an /v1/embeddings request: one float list per input, in input order."""
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": [float(x) for x in vector]}
                 for i, vector in enumerate(vectors)],
        "model": model_name,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
    return _openai_envelope(request.line_number, request.request_id, 200, body, run_id)


def _openai_envelope(line_number: int, custom_id: str, status: int, body: dict,
                     run_id: str = "") -> dict[str, Any]:
    suffix = _suffix(line_number, run_id)
    return {"id": f"batch_req_{suffix}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{suffix}", "body": body},
            "error": None}


def _suffix(line_number: int, run_id: str = "") -> str:
    # record_key reads the line number back from after the last "line" (a hex run id has none)
    return f"{run_id}_line{line_number}" if run_id else f"line{line_number}"


def _openai_finish(c: CompletionOutput) -> str | None:
    return "stop" if c.finish_reason == "stop" or c.finished_by_eos else c.finish_reason


def _completion_choice(c: CompletionOutput, decode_token: DecodeToken, request: JobRequest,
                       output: RequestOutput) -> dict[str, Any]:
    token_ids = list(c.token_ids) if request.generate else []
    rows: list[dict[int, float] | None] = list(c.logprobs or []) if request.generate else []
    text = c.text if request.generate else ""
    if request.echo:
        prompt_ids = list(output.prompt_token_ids)
        prompt_text = request.prompt if request.prompt is not None else \
            "".join(decode_token.text(t) for t in prompt_ids)
        text, token_ids = prompt_text + text, prompt_ids + token_ids
        rows = list(output.prompt_logprobs or [None] * len(prompt_ids)) + rows
    logprobs = None
    if c.logprobs is not None:
        logprobs = {"tokens": [decode_token.text(t) for t in token_ids],
                    "token_logprobs": [None if d is None else _finite(d.get(t))
                                       for t, d in zip(token_ids, rows)],
                    "top_logprobs": [None if d is None else
                                     {decode_token.text(t): _finite(lp) for t, lp in _ranked(d)}
                                     for d in rows],
                    "text_offset": _text_offsets(token_ids, decode_token)}
    return {"index": c.index, "text": text, "logprobs": logprobs,
            "finish_reason": _openai_finish(c)}


def _chat_choice(c: CompletionOutput, decode_token: DecodeToken,
                 num_top: int | None) -> dict[str, Any]:
    """top_logprobs: exactly the num_top most likely tokens ([] when none were asked for)."""
    logprobs = None
    if c.logprobs is not None:
        logprobs = {"content": [
            {**_chat_token(t, d.get(t), decode_token),
             "top_logprobs": [_chat_token(k, lp, decode_token) for k, lp in _ranked(d)[:num_top]]}
            for t, d in zip(c.token_ids, c.logprobs)]}
    return {"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs, "finish_reason": _openai_finish(c)}


def _chat_token(token_id: int, logprob: float | None, decode_token: DecodeToken) -> dict[str, Any]:
    return {"token": decode_token.text(token_id), "logprob": _finite(logprob),
            "bytes": list(decode_token.raw(token_id))}


def _text_offsets(token_ids: list[int], tokens: TokenStrings) -> list[int]:
    """Character offset in the text where each token starts: the characters its predecessors' bytes
    complete (a character split over tokens belongs to the token that completes it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], 0
    for token_id in token_ids:
        offsets.append(at)
        at += len(decoder.decode(tokens.raw(token_id)))
    return offsets


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: -item[1])


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _FLOOR_LOGPROB


def record_key(record: dict[str, Any]) -> str:
    """The key that marks a line done (JobRequest.key / LineError.key of the line it came from)."""
    if "custom_id" in record:
        body = (record.get("response") or {}).get("body") or {}
        if (body.get("error") or {}).get("code") == "duplicate_id":
            return duplicate_key(int(record["id"].rsplit("line", 1)[1]))
        return record["custom_id"]
    if (record.get("error") or {}).get("type") == "duplicate_id":
        return duplicate_key(record["line"])
    return record["id"]


def is_error(record: dict[str, Any]) -> bool:
    if "custom_id" in record:
        response = record.get("response") or {}
        return record.get("error") is not None or response.get("status_code") != 200
    return record.get("error") is not None
