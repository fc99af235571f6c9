"""IncrementalDetokenizer: text of a growing token list, emitted piece by piece, never half a character.

Byte-level BPE tokens can end in the middle of a UTF-8 character (an emoji is often 2-4 tokens), and
decoding such a prefix yields U+FFFD. Each `push` decodes only a short window — the tokens since the
last emitted boundary — and holds back text while it ends in U+FFFD. Decoding the window twice (with
and without the new tokens) and taking the difference also keeps decoders that strip a leading space
(sentencepiece) correct. Cost per token is O(window), not O(sequence).
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Per-sequence streaming state. `push(new_ids)` returns the newly completed text; `text` is
    everything emitted so far (equal to `tokenizer.decode(all ids)` once the sequence ends cleanly)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are fully emitted
        self.read_offset = 0  # tokens before it have had their text emitted
        self.text = ""

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        piece = full_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece
