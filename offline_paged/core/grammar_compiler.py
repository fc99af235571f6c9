"""GrammarCompiler: StructuredOutputsParams -> a compiled llguidance grammar, once per distinct spec, off
the step loop.

Data structure: an LRU dict key -> Future[CompiledGrammar] (`StructuredOutputsParams.key`), filled by a
small thread pool (llguidance drops the GIL while it builds a grammar). 100,000 requests with one schema
compile it once; a request whose grammar is still compiling waits outside the scheduler (the engine's
business), so a slow schema never stalls the batch. A spec that does not compile resolves to a
ValueError naming the problem (that request's error). Failed specs are not kept: a later identical one
fails again in the same way, cheaply.
"""
from __future__ import annotations

import json
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from offline_paged.core.config import require_non_negative
from offline_paged.core.grammar_tokenizer import ll_tokenizer
from offline_paged.core.mask_server import MaskServer
from offline_paged.core.structured_matcher import StructuredMatcher
from offline_paged.core.structured_outputs import StructuredOutputsParams

_MESSAGE_LIMIT = 300
# Errors without the parser's state dump: a job line's error record names the problem, not the internals.
_LIMITS = dict(verbose_errors=False)


@dataclass(slots=True, frozen=True)
class CompiledGrammar:
    """A matcher in the grammar's start state; every sequence gets its own copy (`new_matcher`)."""

    template: llguidance.LLMatcher
    kind: str
    num_words: int  # ceil(vocab / 32): the width of its masks
    text: str = ""  # the llguidance grammar the template was built from
    mask_server: MaskServer | None = None  # fills its matchers' late masks in worker processes

    def new_matcher(self) -> StructuredMatcher:
        return StructuredMatcher(self.template.deep_copy(), self.num_words, self.text, self.mask_server)


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer; `submit` never blocks on a compile."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_workers: int = 2,
                 cache_size: int = 1024, executor: Executor | None = None, mask_processes: int = 0) -> None:
        """executor: where compiles run (default: a pool of max_workers threads, shut down by close).
        mask_processes: > 0 starts a MaskServer of that many processes with the tokenizer, which fills the
        late (overlapped) masks of this compiler's matchers; 0 fills them in this process."""
        require_non_negative("mask_processes", mask_processes)
        self._tokenizer_source = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s for 50k tokens)
        self._tokenizer_lock = threading.Lock()  # the pool's threads build it once
        self._mask_processes = mask_processes
        self.mask_server: MaskServer | None = None  # started with the tokenizer
        self._pool = executor or ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self.num_compiled = 0  # compiles started (a cache hit starts none)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Future[CompiledGrammar] of `params` (raising ValueError when it does not compile)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, params)
        self.num_compiled += 1
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """`submit` and wait (tests, the bench's warm-up)."""
        return self.submit(params).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._tokenizer_lock:
            if self.mask_server is not None:
                self.mask_server.close()
                self.mask_server = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(*self._tokenizer_source)
                if self._mask_processes:  # its workers build their tokenizers while grammars compile here
                    self.mask_server = MaskServer(self._tokenizer_source, self._mask_processes)
        return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        text = grammar_text(params)
        limits = llguidance.LLParserLimits(**_LIMITS)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"invalid structured_outputs {params.kind}: {_cut(matcher.get_error())}")
        server = self._ready_mask_server()
        if server is not None:
            server.add_grammar(text)
        return CompiledGrammar(matcher, params.kind, -(-self.tokenizer.vocab_size // 32), text, server)

    def _ready_mask_server(self) -> MaskServer | None:
        """The mask server once its workers are up (the first compile waits for them, off the step loop);
        None, with a warning, when they failed to start: masks are then filled in this process."""
        server = self.mask_server
        if server is None:
            return None
        try:
            server.ensure_ready()
        except RuntimeError as exc:
            with self._tokenizer_lock:
                if self.mask_server is server:
                    self.mask_server = None
                    server.close()
                    warnings.warn(f"grammar mask processes did not start ({exc}); masks are filled in this "
                                  "process", RuntimeWarning, stacklevel=2)
            return None
        return server


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (ValueError for a GBNF grammar that does not convert)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(params.schema, overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark as it is; GBNF / EBNF converted
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs grammar: {_cut(str(exc))}") from None


def _cut(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MESSAGE_LIMIT else message[:_MESSAGE_LIMIT] + "..."
