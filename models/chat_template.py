"""ChatTemplate: an HF-style Jinja chat template rendered in jinja2's immutable sandbox.

The sandbox keeps a template from reaching Python internals (attribute access to dunders,
mutating the messages); rendering options follow transformers (trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text).
"""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is malformed or raised while rendering."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt, **special_tokens) -> str`."""

    def __init__(self, source: str, origin: str = "chat template"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source
        self.origin = origin
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"{origin}: invalid Jinja template ({exc})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        _check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except ChatTemplateError:
            raise
        except TemplateError as exc:  # includes sandbox SecurityError
            raise ChatTemplateError(f"{self.origin}: rendering failed ({type(exc).__name__}: {exc})") from None


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be a dict with a 'role' (got {message!r})")
