"""ChatTemplate: an HF-style Jinja chat template rendered in a bounded, immutable jinja2 sandbox.

The sandbox keeps a template from reaching Python internals (attribute access to dunders,
mutating the messages); `BoundedSandbox` (models/template_sandbox.py) also bounds each render in
time and size and refuses `{% include %}` / `{% import %}`. Rendering options follow transformers
(trim_blocks, lstrip_blocks, the `loopcontrols` extension, `{% generation %}`, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text). Any failure while rendering, whatever the
template did, is a `ChatTemplateError` (a ValueError) naming the template's origin.
"""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError

from .template_sandbox import BoundedSandbox, RenderTimeout, TemplateLimitError

DEFAULT_MAX_SECONDS = 2.0
BASE_MAX_CHARS = 1_000_000  # plus MAX_CHARS_PER_INPUT_CHAR for every character of the input
MAX_CHARS_PER_INPUT_CHAR = 4
_MAX_TOJSON_INDENT = 16
# Real chat templates are a few KB (the largest we know, with tool-calling, ~30 KB); jinja compiles
# ~7 s per MB, on every load and in every worker, so a larger source is refused before compiling.
MAX_TEMPLATE_CHARS = 256 * 1024


class ChatTemplateError(ValueError):
    """The template is malformed, raised, or went over a limit while rendering."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if isinstance(indent, int) and indent > _MAX_TOJSON_INDENT:
        raise TemplateLimitError(f"tojson indent {indent} is over the limit of {_MAX_TOJSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt, **variables) -> str`.

    Each render may use at most `max_seconds` of CPU time and produce at most BASE_MAX_CHARS +
    MAX_CHARS_PER_INPUT_CHAR x (size of its input) characters (in its output and in any value built
    on the way)."""

    def __init__(self, source: str, origin: str = "chat template", max_seconds: float = DEFAULT_MAX_SECONDS):
        if not isinstance(source, str):
            raise ChatTemplateError(f"{origin}: the chat template must be a string, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"{origin}: the chat template has {len(source):,} characters, over the "
                                    f"limit of {MAX_TEMPLATE_CHARS:,}")
        env = BoundedSandbox()
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.add_filter("tojson", _tojson)
        self._env = env
        self.source = source
        self.origin = origin
        self.max_seconds = max_seconds
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"{origin}: invalid Jinja template ({exc})") from None
        except (ValueError, MemoryError, RecursionError, OverflowError) as exc:  # e.g. deeply nested syntax
            raise ChatTemplateError(f"{origin}: invalid Jinja template ({type(exc).__name__}: {exc})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text. Raises ChatTemplateError (a ValueError) naming the template for any failure."""
        _check_messages(messages)
        max_chars = BASE_MAX_CHARS + MAX_CHARS_PER_INPUT_CHAR * _input_size(messages, variables)
        try:
            return self._render_bounded(messages, add_generation_prompt, variables, max_chars)
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{self.origin}: {exc}") from None
        except (TemplateLimitError, RenderTimeout) as exc:
            raise ChatTemplateError(f"{self.origin}: rendering stopped: {exc}") from None
        except TemplateError as exc:  # includes sandbox SecurityError
            raise ChatTemplateError(f"{self.origin}: rendering failed ({type(exc).__name__}: {exc})") from None
        except Exception as exc:  # MemoryError, RecursionError, TypeError...: the template's fault, not ours
            raise ChatTemplateError(f"{self.origin}: rendering failed ({type(exc).__name__}: {exc})") from None

    def _render_bounded(self, messages, add_generation_prompt, variables, max_chars: int) -> str:
        parts, total = [], 0
        with self._env.bounded(max_chars, self.max_seconds):
            for part in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **variables):
                total += len(part)
                if total > max_chars:
                    raise TemplateLimitError(f"the output is over the limit of {max_chars:,} characters")
                parts.append(part)
        return "".join(parts)


def _input_size(messages, variables) -> int:
    try:
        return len(json.dumps([messages, variables], ensure_ascii=False, default=str))
    except (ValueError, RecursionError):  # circular or absurdly deep input: the base limit only
        return 0


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be a dict with a 'role' (got {repr(message)[:200]})")
