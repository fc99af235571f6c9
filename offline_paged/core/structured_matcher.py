"""StructuredMatcher: one sequence's place in its grammar (an llguidance LLMatcher), and the batch mask fill.

A sequence's matcher has consumed exactly its known output tokens (the stop checker feeds it each
appended token), so a fork copies it with the sequence (n > 1, best_of) and preemption, which keeps the
tokens, keeps it too. The mask of the next token is a packed int32 bitmask, bit t of word t // 32 set
where token t is allowed (llguidance's layout; EOS only where the grammar accepts).
"""
from __future__ import annotations

import itertools
import os

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

_MESSAGE_LIMIT = 300


class StructuredMatcher:
    """Mutable: `accept` advances it; `fork` copies it. Not shared between sequences.

    `history` holds every token it consumed; the llguidance matcher (`_local()`) has consumed the first
    `_consumed` of them. Without a mask server the two are always equal. With one, tokens fed ahead are
    only recorded: the server's worker consumes them into its mirror before it fills the next mask and
    reports the outcome, and this process's matcher catches up only when it is needed here (a fork, a
    mask filled in this process, an outcome the server does not have).

    `advance_ahead` takes a step's tokens for many matchers at once, before the output processor reaches
    them: each then holds the token and its outcome (`_ahead`: the outcome is None while a server computes
    it) until `accept` of that same token reads it, and `is_finished` answers from it. So the output
    processor touches no llguidance matcher while a mask thread fills the next step's masks from them
    (llguidance refuses a matcher borrowed by a fill)."""

    __slots__ = ("_matcher", "num_words", "grammar_text", "mask_server", "uid", "history", "_consumed",
                 "_ahead", "_stopped", "_failed")

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, grammar_text: str = "",
                 mask_server=None) -> None:
        """grammar_text: the llguidance grammar `matcher` was built from (a MaskServer rebuilds it from that
        and `history`); mask_server: the MaskServer that fills its late masks, or None (this process)."""
        self._matcher = matcher
        self.num_words = num_words  # int32 words of its masks: ceil(the grammar tokenizer's vocab / 32)
        self.grammar_text = grammar_text
        self.mask_server = mask_server
        self.uid = next(_UIDS)  # a mask server's name for it
        self.history: list[int] = []  # every token consumed since the grammar's start state
        self._consumed = 0  # tokens of history _matcher has consumed
        self._ahead: tuple[int, tuple[str | None, bool] | None] | None = None  # (token, (error, stopped))
        self._stopped: bool | None = None  # is_stopped() after the last token accepted from `_ahead`
        self._failed = False  # a token was refused

    def _local(self) -> llguidance.LLMatcher:
        """This process's llguidance matcher, caught up with `history`."""
        for token in self.history[self._consumed:]:
            self._matcher.consume_token(token)  # (consume_tokens refuses an EOS after a finished grammar)
        self._consumed = len(self.history)
        return self._matcher

    def fork(self) -> StructuredMatcher:
        if self._ahead is not None:
            raise RuntimeError("a matcher was forked between advance_ahead and accept")
        child = StructuredMatcher(self._local().deep_copy(), self.num_words, self.grammar_text, self.mask_server)
        child.history = list(self.history)
        child._consumed = len(child.history)
        child._stopped, child._failed = self._stopped, self._failed
        return child

    def accept(self, token_id: int) -> str | None:
        """Consume a sampled token; None when the grammar allows it, else the error (the matcher stays
        in its error state). A token consumed by `advance_ahead` is not consumed again: its outcome is read."""
        if self._ahead is not None:
            token, outcome = self._ahead
            self._ahead = None
            if token != token_id:
                raise RuntimeError(f"matcher advanced by token {token} but the sequence appended {token_id}")
            if outcome is None and self.mask_server is not None:
                outcome = self.mask_server.outcome(self.uid, len(self.history))
            if outcome is None:  # not in the server's last fill: this process's matcher consumes it
                local = self._local()
                outcome = (error_message(local, token), local.is_stopped())
            error, self._stopped = outcome
        else:
            self._stopped = None
            self.history.append(int(token_id))
            error = error_message(self._local(), token_id)
        self._failed = self._failed or error is not None
        return error

    @property
    def outcome_pending(self) -> bool:
        """It took its newest token ahead and a mask server is computing that token's outcome (`accept`
        would wait for the server's reply)."""
        return self._ahead is not None and self._ahead[1] is None

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and can take no more tokens (EOS aside)."""
        return self._local().is_stopped() if self._stopped is None else self._stopped

    @property
    def is_failed(self) -> bool:
        """A token was refused (the matcher is in its error state: it allows nothing but EOS)."""
        return self._failed

    @property
    def is_accepting(self) -> bool:
        return self._local().is_accepting()


def error_message(matcher: llguidance.LLMatcher, token_id: int) -> str | None:
    """None when the llguidance matcher is not in its error state (after consuming token_id), else the error."""
    if not matcher.is_error():
        return None  # (a matcher that failed while computing a mask accepts EOS but is in error)
    message = matcher.get_error().strip() or f"token {token_id} is not allowed by the grammar"
    return message if len(message) <= _MESSAGE_LIMIT else message[:_MESSAGE_LIMIT] + "..."


def fill_bitmask_rows(rows: list[tuple[StructuredMatcher, int]], out: np.ndarray) -> None:
    """Write each (matcher, row) pair's next-token mask into out[row] ([R, W] int32, C-contiguous, e.g. a
    pinned staging buffer the device copies from); other rows are left as they are. Parallel over the
    pairs, and without the GIL: a host thread may fill while the caller's thread goes on."""
    if any(m.num_words != out.shape[1] for m, _ in rows):
        raise RuntimeError("matchers of one step were built for different vocabularies")
    if rows:
        llg_numpy.fill_next_token_bitmask_par(_executor(), [(m._local(), row) for m, row in rows], out)


def advance_ahead(pairs: list[tuple[StructuredMatcher, int]]) -> None:
    """Take one token per matcher ahead of the `accept` of the same token by the stop checker, which then
    reads the outcome kept here. Matchers with a mask server only record it (the server's next fill
    consumes it and reports the outcome); the others consume it now, in parallel (llguidance's pool).
    Matchers must be distinct."""
    if any(matcher._ahead is not None for matcher, _ in pairs):
        raise RuntimeError("a matcher was advanced twice before accepting")
    local = []  # (llguidance matcher caught up to before the token, matcher, token)
    served: dict = {}  # mask server -> its matchers fed here
    for matcher, token in pairs:  # (one pass: 256 rows a step on the JSON bench's hot path)
        token = int(token)
        server = matcher.mask_server
        if server is None:
            local.append((matcher._local(), matcher, token))
        else:
            matcher._ahead = (token, None)
            if server in served:
                served[server].append(matcher)
            else:
                served[server] = [matcher]
        matcher.history.append(token)
    for server, matchers in served.items():
        server.fed(matchers)
    if local:
        llg_numpy.consume_token_par(_executor(), [(ll_matcher, token) for ll_matcher, _, token in local])
        for ll_matcher, matcher, token in local:
            matcher._consumed += 1
            matcher._ahead = (token, (error_message(ll_matcher, token), ll_matcher.is_stopped()))


_UIDS = itertools.count()
_EXECUTOR: list[llguidance.LLExecutor] = []  # a thread pool, not state passed between layers


# llguidance's parallel fill scales poorly past a few threads: 256 masks over a 128k vocabulary took 5.1 ms
# on 1 thread, 2.9 on 4, 3.3 on 8 and 4.1 on 16 (a 16-core H200 host; benchmarks/bench_mask_fill.py).
MASK_THREADS = 4


def _executor() -> llguidance.LLExecutor:
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor(num_threads=max(1, min(MASK_THREADS, os.cpu_count() or 1))))
    return _EXECUTOR[0]

