"""StructuredMatcher: one sequence's place in its grammar (an llguidance LLMatcher), and the batch mask fill.

A sequence's matcher has consumed exactly its known output tokens (the stop checker feeds it each
appended token), so a fork copies it with the sequence (n > 1, best_of) and preemption, which keeps the
tokens, keeps it too. The mask of the next token is a packed int32 bitmask, bit t of word t // 32 set
where token t is allowed (llguidance's layout; EOS only where the grammar accepts).
"""
from __future__ import annotations

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

_MESSAGE_LIMIT = 300


class StructuredMatcher:
    """Mutable: `accept` advances it; `fork` copies it. Not shared between sequences."""

    __slots__ = ("_matcher", "num_words")

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int) -> None:
        self._matcher = matcher
        self.num_words = num_words  # int32 words of its masks: ceil(the grammar tokenizer's vocab / 32)

    def fork(self) -> StructuredMatcher:
        return StructuredMatcher(self._matcher.deep_copy(), self.num_words)

    def accept(self, token_id: int) -> str | None:
        """Consume a sampled token; None when the grammar allows it, else the error (the matcher stays
        in its error state)."""
        if self._matcher.consume_token(int(token_id)) and not self._matcher.is_error():
            return None  # (a matcher that failed while computing a mask accepts EOS but is in error)
        message = self._matcher.get_error().strip() or f"token {token_id} is not allowed by the grammar"
        return message if len(message) <= _MESSAGE_LIMIT else message[:_MESSAGE_LIMIT] + "..."

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and can take no more tokens (EOS aside)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def fill_bitmask(self, out: np.ndarray) -> None:
        """out [W] int32 (C-contiguous): the next token's mask."""
        llg_numpy.fill_next_token_bitmask(self._matcher, out.reshape(1, -1))


def fill_bitmasks(matchers: list[StructuredMatcher]) -> np.ndarray:
    """[len(matchers), W] int32: each matcher's next-token mask (W: their num_words, one grammar tokenizer
    per engine), filled in parallel by llguidance's thread pool (one executor per process, made on first use).
    Logits wider than 32 W (a padded vocabulary) treat the tokens past it as not allowed."""
    num_words = matchers[0].num_words if matchers else 0
    if any(m.num_words != num_words for m in matchers):
        raise RuntimeError("matchers of one step were built for different vocabularies")
    masks = np.zeros((len(matchers), num_words), dtype=np.int32)  # [R, W]
    if len(matchers) == 1:
        matchers[0].fill_bitmask(masks[0])
    elif matchers:
        llg_numpy.fill_next_token_bitmask_par(_executor(), [(m._matcher, i) for i, m in enumerate(matchers)], masks)
    return masks


_EXECUTOR: list[llguidance.LLExecutor] = []  # a thread pool, not state passed between layers


def _executor() -> llguidance.LLExecutor:
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]

