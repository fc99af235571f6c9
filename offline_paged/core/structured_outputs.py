"""StructuredOutputsParams: the constraint one request's output must satisfy, spelled as vLLM spells it.

Exactly one of `json` (a JSON schema: an object, or its JSON text), `regex`, `choice` (a list of
strings, the output is one of them), `grammar` (Lark, or GBNF / EBNF as llama.cpp and vLLM's examples
write it) or `json_object=True` (any JSON object) is set. `disable_any_whitespace` makes JSON compact
(no whitespace between tokens), so small models cannot wander off in whitespace.
`GuidedDecodingParams` is vLLM's older name of the same class (`SamplingParams(guided_decoding=...)`).

Pure Python: the grammar itself is compiled by core/grammar_compiler.py (llguidance), once per distinct
`key`, off the engine's step loop.
"""
from __future__ import annotations

import json as json_module
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Grammar kinds, in the order the fields are checked; each names the llguidance input it becomes.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
_MAX_TEXT = 1 << 20  # one schema / grammar of a job line: a megabyte of text is already absurd


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Immutable, validated constraint of one request's output (see the module docstring).

    `json` is kept as canonical JSON text (keys sorted), so two spellings of one schema share one
    compiled grammar; `choice` becomes a tuple.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_fields = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            given = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)} (got {given})")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be true or false, got {self.disable_any_whitespace!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                _text(name, getattr(self, name))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be true or false, got {_show(self.json_object)}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical source text, disable_any_whitespace): what the compiled-grammar cache is keyed by."""
        kind = self.kind
        if kind == "choice":
            source = json_module.dumps(list(self.choice))
        elif kind == "json_object":
            source = ""
        else:
            source = getattr(self, kind)
        return kind, source, self.disable_any_whitespace

    @property
    def schema(self) -> dict | bool | None:
        """The JSON schema as an object (json), {"type": "object"} (json_object), else None."""
        if self.json is not None:
            return json_module.loads(self.json)
        return {"type": "object"} if self.json_object else None

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        """From a JSON object (a job line's "structured_outputs"); unknown keys are an error."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(FIELD_NAMES))
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(map(str, unknown))} "
                             f"(known: {', '.join(FIELD_NAMES)})")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """The set fields only, JSON-ready (the schema as an object)."""
        out: dict[str, Any] = {self.kind: self.schema if self.json is not None else getattr(self, self.kind)}
        if self.choice is not None:
            out["choice"] = list(self.choice)
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name (SamplingParams(guided_decoding=...))
FIELD_NAMES = tuple(f.name for f in fields(StructuredOutputsParams))


def _schema_text(value: Any) -> str:
    """A schema (object, boolean or its JSON text) -> canonical JSON text; ValueError if it is neither."""
    if isinstance(value, str):
        _text("json", value)
        try:
            value = json_module.loads(value)
        except ValueError as exc:
            raise ValueError(f"json must be a JSON schema (an object), but its text is not JSON: {exc}") from None
    if not isinstance(value, (Mapping, bool)):
        raise ValueError(f"json must be a JSON schema (an object), got {type(value).__name__}")
    try:
        return json_module.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"json must be a JSON-serialisable schema: {exc}") from None


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {_show(value)}")
    if len(value) > _MAX_TEXT:
        raise ValueError(f"{name} is {len(value)} characters; the limit is {_MAX_TEXT}")
    return value


def _choices(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"choice must be a list of strings, got {_show(value)}")
    if not value or not all(isinstance(c, str) and c for c in value):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return tuple(value)


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
