"""The JSONL job: read lines, feed the engine, write one record per line as each finishes.

`JobRunner(engine, writer, ...).run(lines) -> JobSummary`. The engine is injected (anything with
add_request / step / has_unfinished_requests / stats / tokenizer), so the loop is tested with a
fake one and runs a DataParallelCoordinator unchanged; step() may hand back a RequestError (a
request refused after add_request returned), which becomes the line's error record. Lines are read
lazily, keeping at most `max_pending` requests inside the engine, so stdin and very large files stream;
they are read in batches (READ_BATCH once the engine has that much room) whose text prompts and rendered
chats are tokenised in one encode_batch call. Bad lines never stop the job: each gets one error record.
Lines whose key is in `done_keys` (from a previous run's output) are skipped, which is how resume works.

Every record carries `request_hash`, a short hash of its line and the job's defaults. Resuming, a
line whose key is done but whose hash differs (the input was edited, or lines without ids shifted)
stops the job with InputChangedError before anything else is written: its old record would
otherwise stand for a request that is no longer in the input. A RequestError marked `unfinished`
(its data-parallel workers died) is written nowhere, so that a rerun runs it again.
"""
import dataclasses
import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from offline_paged.core import gc_pacing
from offline_paged.core.outputs import RequestError, RequestOutput
from offline_paged.job.job_file import JsonlWriter
from offline_paged.job.job_input import EMBEDDINGS, NATIVE, SCORE, JobRequest, LineError, parse_line, score_tokens
from offline_paged.job.job_output import TokenStrings, embedding_record, error_record, success_record
from offline_paged.models.tokenizer import batch_ids

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_INCOMPLETE = 2  # requests left unwritten (their data-parallel workers died): a rerun runs them
EXIT_INTERRUPTED = 130
REQUEST_HASH = "request_hash"  # the record field
MAX_ERROR_MESSAGE_CHARS = 2000  # an error record's message is cut here (a line may quote megabytes)
_FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit)  # the BaseExceptions that are not a line's fault


class InputChangedError(ValueError):
    """Resuming: a line that OUT already holds a record for is not the line that record was made from."""


class Progress(Protocol):
    def update(self, summary: "JobSummary", engine_stats: Any) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class JobSummary:
    """Counts of one run. Failures count error records, including earlier runs' (resume)."""

    num_requests: int = 0  # non-blank input lines seen
    num_succeeded: int = 0
    num_failed: int = 0
    num_skipped: int = 0  # already complete in the output file
    num_failed_before: int = 0  # error records already in the output file (of this input's lines)
    num_unfinished: int = 0  # requests written nowhere (their data-parallel workers died)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        if self.num_unfinished:
            return EXIT_INCOMPLETE
        return EXIT_SOME_FAILED if self.num_failed + self.num_failed_before else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        elapsed = max(self.elapsed_s, 1e-9)
        return {
            "requests": self.num_requests, "succeeded": self.num_succeeded,
            "failed": self.num_failed, "skipped_already_done": self.num_skipped,
            "failed_in_earlier_runs": self.num_failed_before, "unfinished": self.num_unfinished,
            "prompt_tokens": self.num_prompt_tokens, "generated_tokens": self.num_generated_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "generation_tokens_per_s": round(self.num_generated_tokens / elapsed, 2),
            "total_tokens_per_s": round(
                (self.num_prompt_tokens + self.num_generated_tokens) / elapsed, 2),
            "requests_per_s": round(self.num_succeeded / elapsed, 3),
            "interrupted": self.interrupted, "exit_code": self.exit_code,
            "engine": self.engine,
        }


READ_BATCH = 32  # lines read and tokenised together in the steady state (see _fill)


class JobRunner:
    """Drives one engine through one job; see the module docstring."""

    def __init__(self, engine, writer: JsonlWriter, *, defaults: Mapping[str, Any] | None = None,
                 model_name: str = "", done_keys: set[str] | None = None,
                 num_failed_before: int = 0, max_pending: int = 512,
                 progress: Progress | None = None,
                 should_stop: Callable[[], bool] = lambda: False,
                 done_hashes: Mapping[str, str] | None = None,
                 done_error_keys: set[str] | None = None) -> None:
        """`done_hashes`: key -> request_hash of the records already in OUT (a changed line raises
        InputChangedError). `done_error_keys`: the keys of its error records; when given, the
        failures of earlier runs are counted over this input's lines only (else `num_failed_before`)."""
        self.engine = engine
        self.writer = writer
        self.defaults = dict(defaults or {})
        self.model_name = model_name
        self.done_keys = set(done_keys or ())
        self.max_pending = max_pending
        self.progress = progress
        self.should_stop = should_stop
        self.done_hashes = dict(done_hashes or {})
        self.done_error_keys = done_error_keys
        self.summary = JobSummary(num_failed_before=0 if done_error_keys is not None else num_failed_before)
        self._pending: dict[str, JobRequest] = {}
        self._hashes: dict[int, str] = {}  # line number -> request_hash, until its record is written
        self._seen_ids: set[str] = set()
        self.run_id = secrets.token_hex(6)  # in OpenAI response ids: unique per run
        self._openai_seen = False  # an OpenAI-format file: broken lines get its envelope too
        self._token_strings = TokenStrings.of(engine.tokenizer) if engine.tokenizer is not None else None
        # Lines are read (and their prompts tokenised together) once this much room is free in the engine.
        self._read_batch = max(1, min(READ_BATCH, max_pending // 4))

    def run(self, lines: Iterable[str]) -> JobSummary:
        """Run every line; returns when all are written or should_stop() turns true."""
        start = time.perf_counter()
        numbered: Iterator[tuple[int, str]] = iter(enumerate(lines, start=1))
        exhausted = False
        with gc_pacing.paced():
            while not self.should_stop():
                exhausted = exhausted or self._fill(numbered)
                if not self._pending:
                    if exhausted:
                        break
                    continue
                for output in self.engine.step():
                    self._finish(output)
                self._report(start)
        self.summary.interrupted = self.should_stop() and not (exhausted and not self._pending)
        self._report(start)
        return self.summary

    def _fill(self, numbered: Iterator[tuple[int, str]]) -> bool:
        """Read lines until max_pending requests wait in the engine; True when input ran out. Reads only once
        a batch's worth of room is free, so that the prompts of the lines read together are tokenised in one
        call (which the Rust tokenizer spreads over its threads)."""
        if self._pending and self.max_pending - len(self._pending) < self._read_batch:
            return False
        batch: list[JobRequest] = []
        try:
            while len(self._pending) + len(batch) < self.max_pending:
                if self.should_stop():
                    return False
                item = next(numbered, None)
                if item is None:  # the reader may end early when asked to stop: then it is not done
                    return not self.should_stop()
                line_number, text = item
                if not isinstance(text, str):  # an OversizedLine, or a Ray row that is no line: its error
                    self._take(text.error(line_number), batch)
                elif not is_blank(text):
                    self._hashes[line_number] = request_hash(text, self.defaults)
                    self._take(parse_line(line_number, text, self.defaults), batch)
            return False
        finally:
            self._submit_all(batch)

    def _take(self, parsed: JobRequest | LineError, batch: list[JobRequest]) -> None:
        """Count the line; a request to run joins `batch`, the rest are settled here."""
        self.summary.num_requests += 1
        if _is_openai(parsed):
            self._openai_seen = True
        elif self._openai_seen and isinstance(parsed, LineError) and parsed.error_type == "invalid_json":
            parsed = dataclasses.replace(parsed, openai=True)
        if parsed.request_id in self._seen_ids:
            parsed = LineError(parsed.line_number, parsed.request_id, "duplicate_id",
                               f"line {parsed.line_number}: duplicate id {parsed.request_id!r}",
                               _is_openai(parsed))
        else:
            self._seen_ids.add(parsed.request_id)
        if parsed.key in self.done_keys:
            self._skip(parsed)
        elif isinstance(parsed, LineError):
            self._fail(parsed)
        else:
            batch.append(parsed)

    def _skip(self, parsed: JobRequest | LineError) -> None:
        """A line OUT already holds; its record must have been made from this very line."""
        now, then = self._hashes.pop(parsed.line_number, None), self.done_hashes.get(parsed.key)
        if now is not None and then is not None and now != then:
            raise InputChangedError(
                f"line {parsed.line_number} (id {parsed.request_id!r}) is not the line that the output's "
                f"record for this id was made from (the input or the job's flags changed since, or lines "
                f"without an id shifted); restore them, or pass --no-resume to start over")
        self.summary.num_skipped += 1
        if self.done_error_keys is not None and parsed.key in self.done_error_keys:
            self.summary.num_failed_before += 1

    def _submit_all(self, requests: list[JobRequest]) -> None:
        """Submit the requests of the lines read together, in their order; the prompts they give as text (a text
        prompt, with special tokens; a rendered chat, without: the template wrote its own) are tokenised in one
        batch each way. Where a batch cannot be (one text, or a text the tokenizer fails on), each is tokenised
        alone in _submit, so a failing text fails its own line only."""
        texts = [self._prompt_text(request) for request in requests]
        token_ids: list[list[int] | None] = [None] * len(requests)
        for add_special_tokens in (True, False):
            group = [i for i, text in enumerate(texts) if text is not None and text[1] is add_special_tokens]
            batch = batch_ids(self.engine.tokenizer, [texts[i][0] for i in group], add_special_tokens)
            for i, ids in zip(group, batch or ()):
                token_ids[i] = ids
        for request, text, ids in zip(requests, texts, token_ids):
            self._submit(request, text and text[0], ids)

    def _prompt_text(self, request: JobRequest) -> tuple[str, bool] | None:
        """The text this request's prompt ids come from and whether they take special tokens; None for requests
        without one (ids given, scoring, embeddings) and for a chat whose template fails (_submit renders it
        again and rejects the line with the error)."""
        if request.api in (EMBEDDINGS, SCORE) or request.prompt_token_ids is not None:
            return None
        if request.messages is None:
            return None if request.prompt is None else (request.prompt, True)
        try:
            return _chat_text(self.engine.tokenizer, request.messages, request.chat_template_kwargs), False
        except Exception:  # noqa: BLE001 - the line's own error comes from _submit
            return None

    def _submit(self, request: JobRequest, prompt_text: str | None = None,
                token_ids: list[int] | None = None) -> None:
        """Add one request to the engine, or write its error record. `prompt_text`: its prompt text (a chat's
        rendered template) when known already; `token_ids`: that text's ids when tokenised already."""
        if request.api == EMBEDDINGS:
            self._embed(request)
            return
        try:
            request.params.check_output_cost(getattr(self.engine, "max_model_len", None))
            prompt = request.prompt
            token_ids = request.prompt_token_ids if token_ids is None else token_ids
            if request.messages is not None:
                if prompt_text is None:
                    prompt_text = _chat_text(self.engine.tokenizer, request.messages, request.chat_template_kwargs)
                prompt = prompt_text
                if token_ids is None:  # the template writes its own special tokens
                    token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
            if request.api == SCORE:
                token_ids, num_scored = score_tokens(self.engine.tokenizer.encode, request.prompt,
                                                     request.continuation)
                request = dataclasses.replace(request, num_scored_tokens=num_scored)
            self.engine.add_request(request.request_id, prompt=prompt,
                                    prompt_token_ids=token_ids, params=request.params)
        except BaseException as exc:  # noqa: BLE001 - whatever one line does (a tokenizer's panic
            if isinstance(exc, _FATAL):  # is a BaseException), the others still run
                raise
            reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            self._reject(request, reason)
            return
        self._pending[request.request_id] = request

    def _embed(self, request: JobRequest) -> None:
        """An embeddings line runs at once (one forward, no decoding) and is written right away."""
        if not hasattr(self.engine, "embed"):
            self._reject(request, "embeddings are not supported by this engine (data-parallel workers)")
            return
        try:
            token_ids = [self.engine.tokenizer.encode(v) if isinstance(v, str) else list(v) for v in request.inputs]
            vectors = self.engine.embed(token_ids)
        except Exception as exc:  # noqa: BLE001 - whatever one line does, the others still run
            self._reject(request, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")
            return
        num_tokens = sum(map(len, token_ids))
        self.writer.write(embedding_record(request, vectors, num_tokens, self.model_name, self.run_id))
        self.summary.num_succeeded += 1
        self.summary.num_prompt_tokens += num_tokens

    def _reject(self, request: JobRequest, reason: str) -> None:
        self._fail(LineError(request.line_number, request.request_id, "rejected",
                             f"line {request.line_number}: {_cut(reason)}", _is_openai(request)))

    def _finish(self, output: RequestOutput | RequestError) -> None:
        request = self._pending.pop(output.request_id)
        if isinstance(output, RequestError) and output.unfinished:  # not the line's fault: rerun it
            self._hashes.pop(request.line_number, None)
            self.summary.num_unfinished += 1
            return
        if isinstance(output, RequestError):  # refused later, by a data-parallel worker
            self._reject(request, output.message)
            return
        record = success_record(request, output, self.model_name, self._token_strings, self.run_id)
        self._write(record, request.line_number)
        self.summary.num_succeeded += 1
        self.summary.num_prompt_tokens += len(output.prompt_token_ids)
        self.summary.num_generated_tokens += sum(len(c.token_ids) for c in output.outputs)

    def _fail(self, error: LineError) -> None:
        error = dataclasses.replace(error, message=_cut(error.message, MAX_ERROR_MESSAGE_CHARS))
        self._write(error_record(error, self.run_id), error.line_number)
        self.summary.num_failed += 1

    def _write(self, record: dict[str, Any], line_number: int) -> None:
        line_hash = self._hashes.pop(line_number, None)
        if line_hash is not None:
            record[REQUEST_HASH] = line_hash
        self.writer.write(record)

    def _report(self, start: float) -> None:
        self.summary.elapsed_s = time.perf_counter() - start
        stats = self.engine.stats
        self.summary.engine = stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)
        if self.progress is not None:
            self.progress.update(self.summary, stats)


def request_hash(text: str, defaults: Mapping[str, Any]) -> str:
    """A short hash of one input line and the job-wide defaults it runs with (what its record answers)."""
    digest = hashlib.sha256(text.strip(" \t\r\n").encode("utf-8", "surrogateescape"))
    digest.update(b"\0" + json.dumps(defaults, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()[:16]


def is_blank(text: str) -> bool:
    """Blank lines are skipped: JSON whitespace only (space, tab, CR, LF)."""
    return not text.strip(" \t\r\n")


def _cut(message: str, limit: int = 500) -> str:
    return message if len(message) <= limit else message[:limit] + "..."


def _is_openai(parsed: JobRequest | LineError) -> bool:
    return parsed.openai if isinstance(parsed, LineError) else parsed.api not in (NATIVE, SCORE)


def _chat_text(tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text for `messages`, ready for the reply (it holds the template's special tokens)."""
    if template_kwargs:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             chat_template_kwargs=template_kwargs)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
