"""BoundedSandbox: jinja2's immutable sandbox with bounds on what one render may cost.

A chat template comes with the model, so it is untrusted input. The plain sandbox already keeps it
away from Python internals; it does not stop a template from asking for `'x' * 10**10`, doubling a
string in a loop, recursing without end or looping 10**10 times. This environment bounds each
render in:
- size: every value an operator (`*`, `**`, `%`, `+`, `~`), a call or a filter produces is measured
  (strings and containers deeply, integers in bits) against the render's limit, and the operations
  that could blow up inside one C call (repetition, powers, padding widths, replace, join, indent,
  wordwrap, sums of sequences, huge format widths) are measured *before* they run;
- time: a trace function raises once the render has used its CPU time (the rendering thread's, so a
  loaded machine does not shorten it), inside any Python loop;
- depth: calls (macros included) nest at most MAX_CALL_DEPTH deep, so a recursive macro ends in a
  clear error, not wherever Python's recursion limit happens to strike;
- scope: `{% include %}`, `{% import %}` and `{% extends %}` are refused (there is nothing to load).

The limits of the render in progress live in a thread-local `RenderBudget`, set by `bounded()`.
A size violation raises `TemplateLimitError` (a ValueError); the deadline raises `RenderTimeout`
once (a BaseException, so that no `except Exception` on the way can swallow it, and only once so
that the clean-up code after it runs untroubled). Both say which limit was hit.
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

DEFAULT_MAX_CHARS = 1_000_000  # outside a bounded render (e.g. constant folding at compile time)
_MAX_INT_BITS = 1 << 16  # about 20,000 decimal digits
# Nested calls a render may make (a recursive macro): far below where Python's own recursion limit
# (~5 frames per macro level) would end it at some arbitrary point, possibly inside a trace or GC hook.
MAX_CALL_DEPTH = 64
# Trace events (calls and template lines) between two reads of the CPU clock: a read is a system call that took
# ~45% of a traced render of SmolLM2's template; 32 events are a few microseconds of template code.
CLOCK_EVERY = 32
_WIDE_NUMBER = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format string
_NESTED_FIELD = re.compile(r"\{[^{}]*:[^{}]*\{")  # '{0:{1}}': a width taken from the arguments
_REFUSED_STR_METHODS = frozenset({"translate", "maketrans", "format_map", "expandtabs"})
_PADDING_STR_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
_SIZING_CALLS = frozenset({"safe_range", "generate_lorem_ipsum"})
_SIZING_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})


class TemplateLimitError(ValueError):
    """A render went over its time or size limit, or used a feature chat templates may not use."""


class RenderTimeout(BaseException):
    """The render's deadline passed (raised by the trace function, once per render)."""


@dataclass(slots=True)
class RenderBudget:
    max_chars: int  # the most characters/items any value built on the way, or the output, may hold
    deadline: float  # time.thread_time() (this thread's CPU seconds) after which the render is stopped
    max_seconds: float
    timed_out: bool = False
    call_depth: int = 0  # calls (macros included) in progress, nested


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


def deep_size(value, limit: int) -> int:
    """Characters/items in `value`, counting inside containers (shared objects once); stops early
    once over `limit`, so it costs O(limit) at most."""
    total, seen, stack = 0, set(), [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, dict, set, frozenset)) and id(item) not in seen:
            seen.add(id(item))
            total += len(item)
            stack.extend(item.items() if isinstance(item, dict) else item)
        else:
            total += 1
    return total


def _deadline_tracer(budget: RenderBudget):
    """The trace function of one render: Python calls it at every call, and at every line of the template's
    own code, and every CLOCK_EVERY-th of those events reads the clock and raises RenderTimeout (once) past
    the deadline. Closures over the budget: per event, a counter and nothing else."""
    events_left = CLOCK_EVERY

    def check_clock() -> None:
        nonlocal events_left
        events_left = CLOCK_EVERY
        if not budget.timed_out and time.thread_time() > budget.deadline:
            budget.timed_out = True
            raise RenderTimeout(f"rendering took longer than {budget.max_seconds:g} s of CPU time")

    def line_tracer(frame, event, arg):
        nonlocal events_left
        events_left -= 1
        if not events_left:
            check_clock()
        return line_tracer

    def call_tracer(frame, event, arg):
        nonlocal events_left
        events_left -= 1
        if not events_left:
            check_clock()
        return line_tracer if frame.f_code.co_filename == "<template>" else None

    return call_tracer


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, transformers' options (trim/lstrip blocks, loopcontrols, `{% generation %}`),
    and per-render bounds (see the module docstring). Render inside `with env.bounded(...)`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

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
        budget = RenderBudget(max_chars, time.thread_time() + max_seconds, max_seconds)
        self._local.budget = budget
        previous_trace = sys.gettrace()
        sys.settrace(_deadline_tracer(budget))
        try:
            yield budget
        finally:
            sys.settrace(previous_trace)
            self._local.budget = None

    def _raise_if_timed_out(self) -> None:
        """The trace function raised once, and Python turned tracing off; if the render still runs, that
        RenderTimeout was swallowed (raised inside a GC callback, or a function that catches
        BaseException). Every call, filter and operator of the template passes here and ends it."""
        budget = self._local.budget
        if budget is not None and budget.timed_out:
            raise RenderTimeout(f"rendering took longer than {budget.max_seconds:g} s of CPU time")

    def _limit(self) -> int:
        budget = self._local.budget
        return budget.max_chars if budget is not None else DEFAULT_MAX_CHARS

    def check_size(self, value, what: str):
        """Return `value`, or raise if it holds more than the limit (deeply) or is a huge integer."""
        self._raise_if_timed_out()
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would produce an integer of over {_MAX_INT_BITS} bits")
        self._refuse_if_over(deep_size(value, self._limit()), what)
        return value

    def _refuse_if_over(self, estimate: int, what: str) -> None:
        limit = self._limit()
        if estimate > limit:
            raise TemplateLimitError(f"{what} would produce over {min(estimate, 10**18):,} characters or items, "
                                     f"over the limit of {limit:,}")

    def _check_int_args(self, args, kwargs, what: str) -> None:
        limit = self._limit()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
                raise TemplateLimitError(f"{what}: argument {value} is over the limit of {limit:,}")

    # ------------------------------------------------------------ operators
    def call_binop(self, context, operator, left, right):
        what = f"the operator {operator!r}"
        if operator == "*":
            self._precheck_repeat(left, right, what)
        elif operator == "**":
            self._precheck_power(left, right, what)
        elif operator == "%" and isinstance(left, str):
            self._precheck_format(left, right if isinstance(right, tuple) else (right,), {}, what)
        return self.check_size(self.binop_table[operator](left, right), what)

    def _precheck_repeat(self, left, right, what: str) -> None:
        limit = self._limit()
        for seq, count in ((left, right), (right, left)):
            if isinstance(count, int) and isinstance(seq, (str, bytes, list, tuple)):
                self._refuse_if_over(deep_size(seq, limit) * count, what)
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would produce an integer of over {_MAX_INT_BITS} bits")

    @staticmethod
    def _precheck_power(left, right, what: str) -> None:
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * left.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"{what} would produce an integer of over {_MAX_INT_BITS} bits")

    def _precheck_format(self, fmt: str, args, kwargs, what: str) -> None:
        """printf- or str.format-style: no literal width of a million or more, and no width taken from a
        huge argument (`%*s`, `{0:{1}}`)."""
        if _WIDE_NUMBER.search(fmt):
            raise TemplateLimitError(f"{what}: the format string asks for a width of a million or more")
        if "*" in fmt or _NESTED_FIELD.search(fmt):
            self._check_int_args(args, kwargs, what)

    def checked_concat(self, parts):
        limit = self._limit()
        self._refuse_if_over(sum(deep_size(p, limit) for p in parts), "the operator '~'")
        return str_join(parts)

    # ------------------------------------------------------------ calls
    def wrap_str_format(self, value):
        """jinja wraps `'...'.format` at attribute access; check its format string and arguments there."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None or getattr(value, "__name__", "") != "format":
            return wrapped
        fmt, env = value.__self__, self
        env._precheck_format(fmt, (), {}, "str.format")

        def checked_format(*args, **kwargs):
            env._precheck_format(fmt, args, kwargs, "str.format")
            return wrapped(*args, **kwargs)

        return checked_format

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own spelling)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        what = f"the call {name}()"
        __self._raise_if_timed_out()
        receiver = getattr(__obj, "__self__", None)
        if isinstance(receiver, str):
            __self._precheck_str_method(receiver, name, args, kwargs, what)
        elif name in _SIZING_CALLS:
            __self._check_int_args(args, kwargs, what)
        budget = __self._local.budget
        if budget is None:
            return __self.check_size(super().call(__context, __obj, *args, **kwargs), what)
        if budget.call_depth >= MAX_CALL_DEPTH:
            callee = getattr(__obj, "name", None) or name  # a jinja Macro has a name, not a __name__
            raise TemplateLimitError(f"calls nested deeper than {MAX_CALL_DEPTH} (a macro that recurses "
                                     f"without end?) at the call {callee}()")
        budget.call_depth += 1
        try:
            return __self.check_size(super().call(__context, __obj, *args, **kwargs), what)
        finally:
            budget.call_depth -= 1

    def _precheck_str_method(self, text: str, name: str, args, kwargs, what: str) -> None:
        if name in _REFUSED_STR_METHODS:
            raise TemplateLimitError(f"str.{name} is not allowed in a chat template")
        if name in _PADDING_STR_METHODS:
            self._check_int_args(args, kwargs, what)
        elif name == "replace" and len(args) >= 2:
            self._precheck_replace(text, args[0], args[1], what)
        elif name == "join" and args:
            self._precheck_join(text, args[0], what)

    def _precheck_replace(self, text, old, new, what: str) -> None:
        if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
            count = text.count(old) if old else len(text) + 1
            self._refuse_if_over(len(text) + count * max(len(new) - len(old), 0), what)

    def _precheck_join(self, separator: str, items, what: str) -> None:
        if isinstance(items, (list, tuple, range)):
            limit = self._limit()
            self._refuse_if_over(deep_size(list(items) if isinstance(items, range) else items, limit)
                                 + len(separator) * max(len(items) - 1, 0), what)

    # ------------------------------------------------------------ filters
    def _guarded_filter(self, name: str, func):
        env = self
        pass_arg = getattr(func, "jinja_pass_arg", None)  # context / eval context / environment first

        def guarded(*args, **kwargs):
            what = f"the filter {name!r}"
            values = args[1:] if pass_arg is not None else args
            if name in _SIZING_FILTERS:
                env._check_int_args(values, kwargs, what)
            if values:
                env._precheck_filter(name, values[0], values[1:], kwargs, what)
            return env.check_size(func(*args, **kwargs), what)

        if pass_arg is not None:
            guarded.jinja_pass_arg = pass_arg
        return guarded

    def _precheck_filter(self, name: str, value, rest, kwargs, what: str) -> None:
        if name == "replace" and len(rest) >= 2:
            self._precheck_replace(str(value) if isinstance(value, str) else value, rest[0], rest[1], what)
        elif name == "join" and isinstance(value, (list, tuple, range)):
            self._precheck_join(str(rest[0] if rest else kwargs.get("d", "")), value, what)
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            per_line = width if isinstance(width, int) else len(str(width))
            self._refuse_if_over(len(value) + (value.count("\n") + 1) * per_line, what)
        elif name == "wordwrap" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 79)
            wrap = (rest[2] if len(rest) > 2 else kwargs.get("wrapstring")) or "\n"
            lines = len(value) // max(int(width), 1) + value.count("\n") + 1
            self._refuse_if_over(len(value) + lines * len(str(wrap)), what)
        elif name == "format" and isinstance(value, str):
            self._precheck_format(value, rest, kwargs, what)
        elif name == "sum":
            start = rest[1] if len(rest) > 1 else kwargs.get("start", 0)
            if not isinstance(start, (int, float)):
                raise TemplateLimitError(f"{what}: only numbers can be summed in a chat template")
