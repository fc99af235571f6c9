"""HFTokenizer: the part of transformers' tokenizer API that vLLM and eval code call, over our Tokenizer.

`LLM.get_tokenizer()` returns one. Defaults follow transformers, not our Tokenizer: `decode` keeps
special tokens unless told otherwise, and `apply_chat_template` returns token ids unless
`tokenize=False` and adds no generation prompt unless asked.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class HFTokenizer:
    """Wraps a models.tokenizer.Tokenizer (or anything with encode/decode/eos_token_ids)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special = dict(getattr(tokenizer, "special_tokens", {}) or {})

    # ----------------------------------------------------------------- special tokens
    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config's eos_token (as transformers), else the smallest EOS id."""
        named = self._token_id(self.eos_token)
        if named is not None:
            return named
        ids = sorted(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        return ids[0] if ids else None

    @property
    def bos_token_id(self) -> int | None:
        named = self._token_id(self.bos_token)
        return named if named is not None else getattr(self.tokenizer, "bos_token_id", None)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    # ----------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        """Vocabulary strings (byte-level BPE spells a leading space 'Ġ', as transformers shows)."""
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    # ----------------------------------------------------------------- chat
    @property
    def chat_template(self) -> str | None:
        """The model's Jinja template source (None without one), as transformers exposes it."""
        template = getattr(self.tokenizer, "chat_template", None)
        return None if template is None else template.source

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None,
                            continue_final_message: bool = False, tools=None, **template_kwargs: Any):
        """Render with the model's template (or `chat_template`, a Jinja source); extra keyword
        arguments reach the template as variables (e.g. enable_thinking). Ids unless tokenize=False."""
        if continue_final_message:
            raise ValueError("continue_final_message is not supported")
        if tools is not None:
            raise ValueError("tools are not supported")
        messages = [dict(m) for m in conversation]
        text = render_chat(self.tokenizer, messages, add_generation_prompt, chat_template, template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ----------------------------------------------------------------- helpers
    def _token_id(self, token: str | None) -> int | None:
        backend = getattr(self.tokenizer, "backend", None)
        if token is None or backend is None:
            return None
        return backend.token_to_id(token)

    def _id_to_token(self, token_id: int) -> str | None:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        return backend.id_to_token(token_id)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template: str | None,
                template_kwargs: Mapping[str, Any]) -> str:
    """The chat prompt text: the model's template, or `chat_template` source, with extra variables."""
    if chat_template is None and not template_kwargs:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    from offline_paged.models.chat_template import ChatTemplate

    template = ChatTemplate(chat_template, origin="chat_template argument") if chat_template is not None \
        else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError("this model has no chat template; pass chat_template=...")
    variables = {**getattr(tokenizer, "special_tokens", {}), **template_kwargs}
    return template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
