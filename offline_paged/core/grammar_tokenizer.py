"""grammar_tokenizer: our tokenizer as llguidance's LLTokenizer (the token -> bytes table its masks walk).

A `models.tokenizer.Tokenizer` (a HF `tokenizers` backend) is handed over as its tokenizer.json text, so
llguidance reads the byte-level vocabulary, the added tokens and which of them are special itself. Any
other tokenizer (tests' byte tokenizers) must offer `token_bytes(id)` and `special_token_ids`: its table
is built here, special tokens spelled as llguidance expects (0xFF + their name, never matched by text).
Ids from the tokenizer's size up to the model's vocabulary (padding rows of the embedding) are never allowed.
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """An LLTokenizer over `vocab_size` ids whose EOS tokens are `eos_token_ids` (the engine's: the mask
    allows them exactly where the grammar accepts). ValueError if the tokenizer offers no token table."""
    eos = sorted(int(t) for t in eos_token_ids)
    if not eos:
        raise ValueError("structured output needs a model with an EOS token")
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "to_str"):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if not hasattr(tokenizer, "token_bytes"):
        raise ValueError(f"structured output needs a tokenizer with a token table; "
                         f"{type(tokenizer).__name__} has neither a tokenizers backend nor token_bytes()")
    return llguidance.LLTokenizer(_TokenTable(tokenizer, vocab_size, eos[0]), n_vocab=vocab_size, eos_token=eos)


class _TokenTable:
    """The duck-typed tokenizer llguidance's LLTokenizer reads (llguidance.TokenizerWrapper's attributes)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int) -> None:
        specials = set(getattr(tokenizer, "special_token_ids", ()) or ())
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(specials)
        self.tokens = [b"\xff<special_%d>" % i if i in specials else tokenizer.token_bytes(i)
                       for i in range(vocab_size)]
        self.is_tokenizer_wrapper = True
        # byte -> the lowest id whose token is that one byte, for text the tokenizer cannot encode. Built
        # once: llguidance calls the tokenizer while it computes masks, not only while it compiles.
        self._single_byte = {t[0]: i for i, t in reversed(list(enumerate(self.tokens))) if len(t) == 1}

    def __call__(self, text: str | bytes) -> list[int]:
        """Token ids of `text` (llguidance tokenizes grammar literals); a tokenizer that cannot encode
        (random-weight benches) gets the one-byte tokens of the table."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        try:
            return list(self._tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False))
        except (TypeError, ValueError):
            return [self._single_byte[b] for b in data if b in self._single_byte]
