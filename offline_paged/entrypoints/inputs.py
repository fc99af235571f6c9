"""Prompt types with vLLM's names: `TextPrompt` ({"prompt": str}) and `TokensPrompt`
({"prompt_token_ids": [...]}, optionally with the "prompt" text it came from). Plain dicts at run
time (TypedDicts), so `TokensPrompt(prompt_token_ids=ids)` is what vLLM code writes.

Keys we do not act on (multi-modal data, cache salts, ...) are refused by name in `prompt_fields`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


_KNOWN_KEYS = ("prompt", "prompt_token_ids")


def prompt_fields(prompt: Mapping[str, Any]) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt dict; ValueError naming any key we do not support."""
    unsupported = sorted(set(prompt) - set(_KNOWN_KEYS))
    if unsupported:
        raise ValueError(f"prompt field(s) {', '.join(unsupported)} not supported "
                         f"(supported: {', '.join(_KNOWN_KEYS)})")
    if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"], None
    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
