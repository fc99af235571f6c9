"""BoundedSandbox: jinja2's immutable sandbox with bounds on what one render may cost.

A chat template comes with the model, so it is untrusted input. The plain sandbox already keeps it
away from Python internals; it does not stop a template from asking for `'x' * 10**10`, doubling a
string in a loop, recursing without end or looping 10**10 times. This environment bounds each
render in:
- size: every string, list or integer an operator, call or filter produces is checked against the
  render's size limit, and the operations that can blow up in one C call (`*`, `**`, `%`, padding
  and replace, join, indent, wordwrap) are checked *before* they run;
- time: a trace function raises once the render's deadline has passed, inside any Python loop;
- scope: `{% include %}`, `{% import %}` and `{% extends %}` are refused (there is nothing to load).

The limits of the render in progress live in a thread-local `RenderBudget`, set by `bounded()`.
Every violation raises `TemplateLimitError` (a ValueError) saying which limit was hit.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from jinja2 import BaseLoader, nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

_MAX_INT_BITS = 1 << 16  # about 20,000 decimal digits
_WIDE_NUMBER = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format string
_REFUSED_STR_METHODS = frozenset({"translate", "maketrans", "format_map", "expandtabs"})


class TemplateLimitError(ValueError):
    """A render went over its time or size limit, or used a feature chat templates may not use."""


@dataclass(slots=True)
class RenderBudget:
    max_chars: int  # longest string or list any step may produce, and the longest output
    deadline: float  # time.monotonic() after which the render is stopped
    max_seconds: float


class _Local(threading.local):
    budget: RenderBudget | None = None


class _NoLoader(BaseLoader):
    def get_source(self, environment, template):
        raise TemplateLimitError(f"{{% include %}} / {{% import %}} / {{% extends %}} are not supported in a "
                                 f"chat template (it asked for {template!r})")


class GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks the assistant's part; renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame) -> None:  # `a ~ b` goes through a size check
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, transformers' options (trim/lstrip blocks, loopcontrols, `{% generation %}`),
    and per-render bounds (see the module docstring). Render inside `with env.bounded(...)`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+", "//"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, loader=_NoLoader(),
                         extensions=["jinja2.ext.loopcontrols", GenerationTag])
        self._local = _Local()
        self.filters = {name: self._guarded_filter(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, func) -> None:
        """Register a filter behind the same size checks as jinja's own."""
        self.filters[name] = self._guarded_filter(name, func)

    # ------------------------------------------------------------ the render's budget
    @contextmanager
    def bounded(self, max_chars: int, max_seconds: float):
        """Apply the limits to everything rendered inside the block (this thread only)."""
        self._local.budget = RenderBudget(max_chars, time.monotonic() + max_seconds, max_seconds)
        previous_trace = sys.gettrace()
        sys.settrace(self._tracer)
        try:
            yield self._local.budget
        finally:
            sys.settrace(previous_trace)
            self._local.budget = None

    def _tracer(self, frame, event, arg):
        self._check_time()
        return self._line_tracer if frame.f_code.co_filename == "<template>" else None

    def _line_tracer(self, frame, event, arg):
        self._check_time()
        return self._line_tracer

    def _check_time(self) -> None:
        budget = self._local.budget
        if budget is not None and time.monotonic() > budget.deadline:
            raise TemplateLimitError(f"rendering took longer than {budget.max_seconds:g} s")

    def _max_chars(self) -> int:
        budget = self._local.budget
        return budget.max_chars if budget is not None else 1_000_000

    def check_size(self, value, what: str):
        """Return `value`, or raise if it is a string/sequence or integer over the limit."""
        limit = self._max_chars()
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > limit:
            raise TemplateLimitError(f"{what} would produce {len(value):,} items, over the limit of {limit:,}")
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would produce an integer of over {_MAX_INT_BITS} bits")
        return value

    def _refuse_if_over(self, estimate: int, what: str) -> None:
        limit = self._max_chars()
        if estimate > limit:
            raise TemplateLimitError(f"{what} would produce about {estimate:,} items, over the limit of {limit:,}")

    # ------------------------------------------------------------ operators
    def call_binop(self, context, operator, left, right):
        what = f"the operator {operator!r}"
        if operator == "*":
            self._precheck_repeat(left, right, what)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * max(left.bit_length(), 1) > _MAX_INT_BITS:
                raise TemplateLimitError(f"{what} would produce an integer of over {_MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            self._precheck_format(left, right if isinstance(right, tuple) else (right,), {}, what)
        return self.check_size(self.binop_table[operator](left, right), what)

    def _precheck_repeat(self, left, right, what: str) -> None:
        for seq, count in ((left, right), (right, left)):
            if isinstance(count, int) and hasattr(seq, "__len__") and not isinstance(seq, dict):
                self._refuse_if_over(len(seq) * count, what)
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"{what} would produce an integer of over {_MAX_INT_BITS} bits")

    def _precheck_format(self, fmt: str, args, kwargs, what: str) -> None:
        if _WIDE_NUMBER.search(fmt):
            raise TemplateLimitError(f"{what}: the format string asks for a width of a million or more")
        self._check_int_args(args, kwargs, what)

    def checked_concat(self, parts):
        total = sum(len(p) if isinstance(p, str) else 0 for p in parts)
        self._refuse_if_over(total, "the operator '~'")
        return self.check_size(str_join(parts), "the operator '~'")

    # ------------------------------------------------------------ calls and filters
    def wrap_str_format(self, value):
        """`'...'.format` is wrapped by jinja at attribute access; check its format string there."""
        if isinstance(getattr(value, "__self__", None), str) and getattr(value, "__name__", "") == "format":
            self._precheck_format(value.__self__, (), {}, "str.format")
        return super().wrap_str_format(value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own spelling)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        what = f"the call {name}()"
        receiver = getattr(__obj, "__self__", None)
        if isinstance(receiver, str):
            __self._precheck_str_method(receiver, name, args, kwargs, what)
        __self._check_int_args(args, kwargs, what)
        return __self.check_size(super().call(__context, __obj, *args, **kwargs), what)

    def _precheck_str_method(self, text: str, name: str, args, kwargs, what: str) -> None:
        if name in _REFUSED_STR_METHODS:
            raise TemplateLimitError(f"str.{name} is not allowed in a chat template")
        if name == "replace" and len(args) >= 2:
            self._precheck_replace(text, args[0], args[1], what)
        elif name == "join" and args:
            self._precheck_join(text, args[0], what)
        elif name == "format":
            self._precheck_format(text, args, kwargs, what)

    def _precheck_replace(self, text, old, new, what: str) -> None:
        if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
            count = text.count(old) if old else len(text) + 1
            self._refuse_if_over(len(text) + count * max(len(new) - len(old), 0), what)

    def _precheck_join(self, separator, items, what: str) -> None:
        if isinstance(items, (list, tuple, range)) and isinstance(separator, str):
            lengths = sum(len(x) if isinstance(x, str) else 24 for x in items)
            self._refuse_if_over(lengths + len(separator) * max(len(items) - 1, 0), what)

    def _check_int_args(self, args, kwargs, what: str) -> None:
        limit = self._max_chars()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
                raise TemplateLimitError(f"{what}: argument {value} is over the limit of {limit:,}")

    def _guarded_filter(self, name: str, func):
        env = self

        def guarded(*args, **kwargs):
            what = f"the filter {name!r}"
            env._check_int_args(args, kwargs, what)
            env._precheck_filter(name, args, kwargs, what)
            return env.check_size(func(*args, **kwargs), what)

        for attr in ("jinja_pass_arg",):  # keep context/environment passing as the filter declared it
            if hasattr(func, attr):
                setattr(guarded, attr, getattr(func, attr))
        return guarded

    def _precheck_filter(self, name: str, args, kwargs, what: str) -> None:
        values = [a for a in args if not hasattr(a, "environment") and not hasattr(a, "autoescape")]
        if not values:
            return
        text, rest = values[0], values[1:]
        if name == "replace" and len(rest) >= 2:
            self._precheck_replace(str(text), rest[0], rest[1], what)
        elif name == "join" and isinstance(text, (list, tuple, range)):
            self._precheck_join(str(rest[0]) if rest else str(kwargs.get("d", "")), text, what)
        elif name in ("indent", "wordwrap") and isinstance(text, str):
            self._precheck_lines(name, text, rest, kwargs, what)
        elif name == "format" and isinstance(text, str):
            self._precheck_format(text, rest, kwargs, what)

    def _precheck_lines(self, name: str, text: str, rest, kwargs, what: str) -> None:
        if name == "indent":
            width = rest[0] if rest else kwargs.get("width", 4)
            per_line = width if isinstance(width, int) else len(str(width))
            self._refuse_if_over(len(text) + (text.count("\n") + 1) * per_line, what)
        else:
            width = rest[0] if rest else kwargs.get("width", 79)
            wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
            lines = len(text) // max(int(width), 1) + text.count("\n") + 1
            self._refuse_if_over(len(text) + lines * len(str(wrap)), what)
