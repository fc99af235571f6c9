"""BoundedSandbox (models/template_sandbox.py), through ChatTemplate: hostile templates end promptly in one
clear error, the time limit cannot be swallowed or leak out, ordinary templates still work; deep_size."""
import numpy as np
import pytest

from offline_paged.models.chat_template import DEFAULT_MAX_SECONDS, ChatTemplate, ChatTemplateError
from offline_paged.models.template_sandbox import deep_size

from sandbox_clock import count_sandbox_clock
from test_chat_template import USER
from tiny_llama import CHATML


def test_deep_size_counts_inside_containers_once_and_stops_early():
    rng = np.random.default_rng(12)
    words = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, size=int(n))) for n in rng.integers(0, 9, size=20)]
    row = {"k": words[:5], "n": 3}
    value = [row, row, tuple(words[5:]), None]
    # outer list 4 + dict 2 + (keys 1+1, list 5 + chars, 3 -> 1) + tuple 15 + chars + None 1
    want = 4 + 2 + 1 + 1 + 5 + sum(map(len, words[:5])) + 1 + 15 + sum(map(len, words[5:])) + 1
    want += 2 * 2  # each of the two (key, value) item tuples counts its 2 entries
    want += 1  # the second reference to `row` counts 1, not its contents again
    assert deep_size(value, 10**6) == want
    assert deep_size(value, 10) <= 10 + max(map(len, words)) + 15  # stops soon after passing the limit
    shared = ["x" * 1000] * 1000  # one string shared 1000 times: 1000 items + 1000 * 1000 chars
    assert deep_size(shared, 5000) < 7000


# --------------------------------------------------------------------------- hostile templates
HOSTILE = {
    "include": ("{% include 'other.jinja' %}", r"include.*not supported.*'other\.jinja'"),
    "import": ("{% import 'macros.jinja' as m %}{{ m.f() }}", r"import.*not supported"),
    "extends": ("{% extends 'base.jinja' %}", r"extends.*not supported"),
    "huge_range": ("{% for i in range(10**9) %}{% endfor %}", r"range.*over the limit"),
    "repeat": ("{{ 'x' * 10**10 }}", r"operator '\*'.*over the limit"),
    "list_repeat": ("{{ [1, 2] * 10**9 }}", r"operator '\*'.*over the limit"),
    "power": ("{{ 2 ** (10 ** 9) }}", r"operator '\*\*'.*integer"),
    "doubling_concat": ("{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s | length }}", r"operator '~'.*over the limit"),
    "doubling_plus": ("{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", r"operator '\+'.*over the limit"),
    "squaring": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                 "{% endfor %}", r"integer of over"),
    "center": ("{{ 'x' | center(10**10) }}", r"filter 'center'.*over the limit"),
    "ljust": ("{{ 'x'.ljust(10**10) }}", r"ljust.*over the limit"),
    "replace": ("{{ ('x' * 900000).replace('x', 'yyyyy') }}", r"replace.*over the limit"),
    "replace_filter": ("{{ ('x' * 900000) | replace('', 'yyyyy') }}", r"filter 'replace'.*over the limit"),
    "join": ("{{ (['abcdefgh' * 100000] * 20) | join('-') }}",
             r"over the limit"),
    "format_width": ("{{ '%999999999s' % 'x' }}", r"width of a million"),
    "format_method": ("{{ '{:>999999999}'.format('x') }}", r"width of a million"),
    "indent": ("{{ ('a\n' * 500000) | indent(100) }}", r"filter 'indent'.*over the limit"),
    "translate": ("{{ 'x'.translate({120: 'y'}) }}", r"str\.translate is not allowed"),
    "lipsum": ("{{ lipsum(10**9) }}", r"lorem_ipsum\(\).*over the limit"),
    "tojson_indent": ("{{ messages | tojson(indent=10**6) }}", r"tojson indent"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"calls nested deeper than 64"),
    "long_output": ("{% for i in range(100000) %}{{ 'x' * 50 }}{% endfor %}", r"output is over the limit"),
    "int_digits": ("{{ 10 ** 5000 }}", r"rendering failed \(ValueError"),
    "undefined_call": ("{{ nothing() }}", r"rendering failed \(UndefinedError"),
    "shared_list_printed": ("{% set big = ['x' * 900000] * 500000 %}{{ big }}", r"operator '\*'.*over the limit"),
    "shared_list_concat": ("{% set row = ['x' * 900000] %}{% set big = [row] * 500000 %}{{ big ~ '' }}",
                           r"operator '\*'.*over the limit"),
    "nested_format_width": ("{{ '{0:{1}}'.format('x', 10**9) }}", r"str\.format: argument 1000000000"),
    "star_width": ("{{ '%*s' % (10**9, 'x') }}", r"operator '%': argument 1000000000"),
    "sum_of_lists": ("{{ ([[1]] * 100000) | sum(start=[]) }}", r"only numbers can be summed"),
    # 900,000 one-item lists take ~1 s of Python: on a slow machine the time limit may come first
    "batch_one": ("{{ ('x' * 900000) | batch(1) | list | length }}", r"over the limit|took longer than 2 s"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_one_clear_error(name, monkeypatch):
    """Each ends promptly, with bounded memory, in a ChatTemplateError (a ValueError) naming the template.
    "Promptly" is counted: the sandbox's clock reads (one per traced call or template line) stay within
    its deadline's, 1 µs a read (the size limits stop all but the time-limited ones far sooner)."""
    clock = count_sandbox_clock(monkeypatch, step=1e-6)
    source, message = HOSTILE[name]
    with pytest.raises(ChatTemplateError, match=message) as info:
        ChatTemplate(source, origin="hostile/tokenizer_config.json").render(USER)
    assert str(info.value).startswith("hostile/tokenizer_config.json: ")
    assert isinstance(info.value, ValueError)
    assert clock.reads <= clock.reads_to(DEFAULT_MAX_SECONDS) + 1


def test_nested_loops_stop_at_the_deadline(monkeypatch):
    import sys

    before = sys.gettrace()
    clock = count_sandbox_clock(monkeypatch, step=1e-4)
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     origin="slow.jinja", max_seconds=0.3)
    with pytest.raises(ChatTemplateError, match=r"slow\.jinja: rendering stopped: rendering took longer than 0\.3 s "
                                                r"of CPU time"):
        t.render(USER)
    assert clock.reads == clock.reads_to(0.3) + 1  # the render's start, then the first check past the deadline
    assert sys.gettrace() is before
    assert ChatTemplate(CHATML, max_seconds=0.3).render(USER).startswith("<|im_start|>user")  # still usable


def test_the_clock_is_read_once_per_clock_every_trace_events(monkeypatch):
    """Reading the CPU clock is a system call; at every event it was ~45% of a render of SmolLM2's template."""
    from offline_paged.models import template_sandbox

    events = []
    deadline_tracer = template_sandbox._deadline_tracer

    def counted(fn):  # the sandbox's trace function, each event it sees counted
        def trace(frame, event, arg):
            events.append(event)
            local = fn(frame, event, arg)
            return None if local is None else counted(local)
        return trace

    monkeypatch.setattr(template_sandbox, "_deadline_tracer", lambda budget: counted(deadline_tracer(budget)))
    clock = count_sandbox_clock(monkeypatch, step=1e-9)
    assert ChatTemplate("{% for i in range(2000) %}{{ i }}{% endfor %}").render(USER).endswith("1999")
    assert len(events) > 2000  # the loop's lines at least
    assert clock.reads == 1 + len(events) // 32  # the render's start, then every 32nd event


def test_the_deadline_counts_cpu_time_not_the_wall_clock():
    """A machine loaded by other jobs (time passing while this thread waits) must not fail a render
    that itself is cheap: here a filter waits 0.5 s of wall time against a 0.2 s budget."""
    import time

    t = ChatTemplate("{{ wait(messages[0]['content']) }}", origin="waits.jinja", max_seconds=0.2)
    t._env.globals["wait"] = lambda value: time.sleep(0.5) or value
    assert t.render(USER) == USER[0]["content"]


def test_deadline_cannot_be_swallowed_by_a_filter():
    """jinja's int filter catches ValueError; the deadline must still end the render."""
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' if (j | int) else '' }}"
                     "{% endfor %}{% endfor %}", origin="t.jinja", max_seconds=0.2)
    with pytest.raises(ChatTemplateError, match=r"t\.jinja: rendering stopped: rendering took longer"):
        t.render(USER)


def test_limits_do_not_leak_out_of_a_render():
    import sys

    before = sys.gettrace()
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ 'x' * 10**10 }}").render(USER)
    assert sys.gettrace() is before
    assert "x" * 3_000_000  # plain Python is not bounded afterwards


def test_ordinary_numbers_and_formats_still_work():
    t = ChatTemplate("{{ '%d|%05.1f' % (1700000000, 2.5) }} {{ '{:>8}'.format(123456789012) }} "
                     "{{ '%s' | format(10**12) }} {{ [1, 2, 3] | sum }} {{ 'ab' * 3 }} {{ 2 ** 10 }}")
    assert t.render(USER) == "1700000000|002.5 123456789012 1000000000000 6 ababab 1024"


def test_long_legit_input_fits_its_limit():
    content = "word " * 400_000  # 2 MB of message: the limit grows with the input
    out = ChatTemplate(CHATML).render([{"role": "user", "content": content}])
    assert len(out) > len(content)



def test_loopcontrols_generation_tag_and_template_kwargs():
    source = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
              "{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
              "{% else %}{{ m['content'] }}{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
              "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "late"}]
    t = ChatTemplate(source)
    assert t.render(messages) == "u[a]"
    assert t.render(messages, enable_thinking=False) == "u[a]<no-think>"


def test_macros_may_nest_to_the_call_depth_limit_and_no_further():
    """A template recursing 60 levels (deeper than any real chat template's schema walk) renders; one
    recursing past MAX_CALL_DEPTH stops with the depth error, never with Python's RecursionError."""
    from offline_paged.models.template_sandbox import MAX_CALL_DEPTH

    source = "{% macro f(n) %}{% if n < N %}{{ f(n + 1) }}{% else %}{{ n }}{% endif %}{% endmacro %}{{ f(0) }}"
    assert ChatTemplate(source.replace("N", "60"), origin="deep.jinja").render(USER) == "60"
    with pytest.raises(ChatTemplateError, match=rf"deep\.jinja: rendering stopped: calls nested deeper than {MAX_CALL_DEPTH}"):
        ChatTemplate(source.replace("N", str(MAX_CALL_DEPTH + 1)), origin="deep.jinja").render(USER)


def test_a_huge_template_source_is_refused_before_it_compiles(monkeypatch):
    """A 10 MB template compiled for 71 s on every load (in every data-parallel worker)."""
    from offline_paged.models.chat_template import MAX_TEMPLATE_CHARS
    from offline_paged.models.template_sandbox import BoundedSandbox

    source = "{{ 'x' }}" * (MAX_TEMPLATE_CHARS // 9 + 1)
    compiled = []  # counted, not timed: the refusal comes before jinja sees the source
    original = BoundedSandbox.from_string
    monkeypatch.setattr(BoundedSandbox, "from_string", lambda self, text, *a, **k: compiled.append(len(text))
                        or original(self, text, *a, **k))
    with pytest.raises(ChatTemplateError, match=rf"big\.jinja: the chat template has [\d,]+ characters, over the "
                                                rf"limit of {MAX_TEMPLATE_CHARS:,}"):
        ChatTemplate(source, origin="big.jinja")
    assert compiled == []
    ChatTemplate(CHATML + " " * (MAX_TEMPLATE_CHARS - len(CHATML)))  # at the limit: fine
    assert compiled == [MAX_TEMPLATE_CHARS]


def test_a_swallowed_deadline_is_raised_again_at_the_next_call(monkeypatch):
    """The trace function can fire inside a GC callback (seen under Hypothesis) or a Python function
    that catches BaseException: the first RenderTimeout is lost there, Python turns tracing off, and
    the render used to go on with no time limit at all."""
    import time

    calls = []

    def tick():  # a Python call: the trace function runs (and raises) at its call event
        return 0

    def swallow():
        calls.append(1)
        try:
            spin_until = time.thread_time() + (0.5 if len(calls) == 1 else 0)
            while time.thread_time() < spin_until:  # the deadline passes in here...
                tick()
        except BaseException:  # noqa: BLE001 - ...and its RenderTimeout is swallowed, as a gc callback's is
            pass
        return ""

    clock = count_sandbox_clock(monkeypatch, step=1e-4)  # the deadline passes after 2,000 traced calls
    t = ChatTemplate("{% for i in range(1000) %}{% for j in range(1000) %}{{ swallow() }}{% endfor %}"
                     "{% endfor %}", origin="swallow.jinja", max_seconds=0.2)
    t._env.globals["swallow"] = swallow
    with pytest.raises(ChatTemplateError, match=r"took longer than 0\.2 s of CPU time"):
        t.render(USER)
    assert calls == [1]  # the next call after the swallowed deadline ends the render (not 10^6 of them)
    assert clock.reads <= clock.reads_to(0.2) + 1  # tracing stopped at the raise
    assert len(calls) < 10  # stopped at the next call, not after a million of them
