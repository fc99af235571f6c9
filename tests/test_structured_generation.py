"""Structured output end to end on a tiny random model: every output satisfies its constraint (JSON schemas
and regexes drawn by Hypothesis, greedy and sampled), our mask application equals llguidance's, forks and
preemption keep each sample's grammar state, and a bad grammar or a failing matcher ends only its request."""
from __future__ import annotations

import functools
import json
import re
import threading
from concurrent.futures import Executor, ThreadPoolExecutor

import jsonschema
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offline_paged import SamplingParams, StructuredOutputsParams
from offline_paged.core.grammar_compiler import GrammarCompiler
from offline_paged.core.outputs import RequestError
from offline_paged.core.structured_matcher import advance_ahead, fill_bitmask_rows
from offline_paged.worker.sampler import SamplingRequest, apply_token_bitmasks, unpack_bitmask
from tiny_engine import EOS_ID, VOCAB_SIZE, ByteTokenizer, run_to_completion, tiny_engine

TOKENIZER = ByteTokenizer()
PROMPT = TOKENIZER.encode("Answer: ")
_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def engine():
    return tiny_engine(max_num_seqs=16, max_num_batched_tokens=128)


def generate(requests: dict, eng=None) -> dict:
    return run_to_completion(eng or engine(), requests)


# ------------------------------------------------------------------ strategies
_NAMES = st.sampled_from(["a", "b", "id", "name", "x_1"])
_LEAVES = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.just({"type": "boolean"}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
)


def _arrays(items):
    return st.tuples(items, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def _objects(values):
    return st.dictionaries(_NAMES, values, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


SCHEMAS = st.recursive(_LEAVES, lambda inner: st.one_of(_arrays(inner), _objects(inner)), max_leaves=5)
TOP_SCHEMAS = st.one_of(_objects(SCHEMAS), _arrays(SCHEMAS))

_ATOMS = st.one_of(st.sampled_from(list("abc019-")).map(re.escape), st.sampled_from(["[a-c]", "[0-9]", "[xyz]"]))
_PIECES = st.tuples(_ATOMS, st.sampled_from(["", "?", "{1,3}", "{2}"])).map("".join)
_BRANCHES = st.lists(_PIECES, min_size=1, max_size=4).map("".join)
REGEXES = st.lists(_BRANCHES, min_size=1, max_size=3).map(lambda b: b[0] if len(b) == 1 else f"({'|'.join(b)})")


def _max_json_bytes(schema) -> int:
    """The longest JSON text of a value `schema` (of the strategies above) admits, in bytes: an upper bound on its
    tokens (each token is at least one byte). A string character counts 12 (a surrogate pair's two escapes)."""
    if "enum" in schema:
        return max(len(json.dumps(value).encode()) for value in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return len("false")
    if kind == "string":
        return 2 + 12 * schema["maxLength"]
    if kind == "array":
        return 2 + schema["maxItems"] * (_max_json_bytes(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(name)) + 2 + _max_json_bytes(value) for name, value in schema["properties"].items())


def _json_params(schema, temperature: float, seed: int = 0, max_tokens: int = 400, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                          **kwargs)


def _assert_valid_json(completion, schema) -> None:
    assert completion.finish_reason == "stop", f"did not finish: {completion.text!r}"
    jsonschema.validate(json.loads(completion.text), schema)


# ------------------------------------------------------------------ every output satisfies its constraint
@_SETTINGS
@given(schema=TOP_SCHEMAS, seed=st.integers(0, 2**32))
def test_every_json_output_validates_greedy_and_sampled(schema, seed):
    # Room for the schema's longest value (twice it, plus some: a grammar may admit spellings the bound does not
    # count, e.g. an integer as 1.0), so every output must end by the grammar's stop; 400 cut off 0.8% of schemas.
    budget = 2 * _max_json_bytes(schema) + 16
    outputs = generate({"greedy": (PROMPT, _json_params(schema, 0.0, max_tokens=budget)),
                        "sampled": (PROMPT, _json_params(schema, 1.0, seed, max_tokens=budget)),
                        "hot": (PROMPT, _json_params(schema, 2.0, seed + 1, max_tokens=budget, top_k=50))})
    for output in outputs.values():
        _assert_valid_json(output.outputs[0], schema)


@_SETTINGS
@given(regex=REGEXES, seed=st.integers(0, 2**32))
def test_every_regex_output_matches_greedy_and_sampled(regex, seed):
    spec = StructuredOutputsParams(regex=regex)
    outputs = generate({f"r{t}": (PROMPT, SamplingParams(max_tokens=64, temperature=t, seed=seed,
                                                         structured_outputs=spec)) for t in (0.0, 1.0, 3.0)})
    for output in outputs.values():
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert re.fullmatch(regex, completion.text), (regex, completion.text)


def test_without_the_grammar_the_same_requests_would_not_have_validated():
    """The property tests can fail: unconstrained, the random model writes bytes, not JSON."""
    outputs = generate({"free": (PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=1))})
    with pytest.raises(ValueError):
        json.loads(outputs["free"].outputs[0].text)


def test_choice_grammar_json_object_and_flexible_whitespace():
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    gbnf = StructuredOutputsParams(grammar='root ::= "yes" | "no" " " [0-9]')
    lark = StructuredOutputsParams(grammar='start: "a" NUM\nNUM: /[0-9]{2}/')
    outputs = generate({
        "choice": (PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=2, structured_outputs=choice)),
        "gbnf": (PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured_outputs=gbnf)),
        "lark": (PROMPT, SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=lark)),
        "object": (PROMPT, SamplingParams(max_tokens=300, temperature=0.0,
                                          structured_outputs={"json_object": True, "disable_any_whitespace": True})),
    })
    assert outputs["choice"].outputs[0].text in ("red", "green", "blue")
    assert re.fullmatch(r"yes|no [0-9]", outputs["gbnf"].outputs[0].text)
    assert re.fullmatch(r"a[0-9]{2}", outputs["lark"].outputs[0].text)
    obj = outputs["object"].outputs[0]  # any object: its keys are free strings, which may run to max_tokens
    assert obj.text.startswith("{")
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)


def test_a_completed_grammar_finishes_the_sequence_and_eos_comes_only_where_it_accepts():
    spec = StructuredOutputsParams(regex="ab?")
    # ignore_eos aside, "a" is accepting: EOS may come there, "ab" ends the grammar without one
    outputs = generate({f"s{seed}": (PROMPT, SamplingParams(max_tokens=10, temperature=5.0, seed=seed,
                                                            structured_outputs=spec)) for seed in range(12)})
    for output in outputs.values():
        c = output.outputs[0]
        assert c.text in ("a", "ab") and c.finish_reason == "stop"
        assert c.token_ids[-1] == EOS_ID or c.text == "ab"
        assert EOS_ID not in c.token_ids[:-1]


# ------------------------------------------------------------------ masks
@settings(max_examples=40, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 100), rows=st.integers(1, 4))
def test_our_mask_application_equals_llguidance_own(data, vocab, rows):
    words = data.draw(st.integers(1, -(-vocab // 32) + 1))
    masks = np.array(data.draw(st.lists(st.lists(st.integers(-2**31, 2**31 - 1), min_size=words, max_size=words),
                                        min_size=rows, max_size=rows)), dtype=np.int32)  # [R, W]
    logits = np.random.default_rng(vocab).standard_normal((rows, vocab)).astype(np.float32)  # [R, V]
    theirs = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(theirs, masks)
    ours = logits.astype(np.float64)
    requests = [SamplingRequest(SamplingParams(), 0, 0, (), (), masks[r]) for r in range(rows)]
    apply_token_bitmasks(ours, requests)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    np.testing.assert_array_equal(ours[~np.isneginf(ours)], logits[~np.isneginf(theirs)])


def test_the_mask_allows_exactly_the_tokens_the_matcher_accepts():
    compiled = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,)).compile(
        StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}}))
    matchers = [compiled.new_matcher() for _ in range(3)]
    for token in TOKENIZER.encode('{"k":1'):
        assert matchers[1].accept(token) is None
    for token in TOKENIZER.encode('{"k":12}'):
        assert matchers[2].accept(token) is None
    masks = np.zeros((len(matchers), matchers[0].num_words), dtype=np.int32)  # [R, W]
    fill_bitmask_rows(list(zip(matchers, range(len(matchers)))), masks)  # in parallel
    for matcher, mask in zip(matchers, masks):
        allowed = unpack_bitmask(mask[None], VOCAB_SIZE)[0]
        accepted = [matcher.fork().accept(t) is None for t in range(VOCAB_SIZE)]
        assert allowed.tolist() == accepted
    assert not unpack_bitmask(masks[:1], VOCAB_SIZE)[0, EOS_ID]  # '' is not an object yet
    assert unpack_bitmask(masks[2:], VOCAB_SIZE)[0].nonzero()[0].tolist() == [EOS_ID]  # complete: EOS only


def test_tokens_fed_ahead_give_the_outcomes_of_accepting_them_one_by_one():
    """advance_ahead consumes a step's tokens for many matchers at once; `accept` of the same token then
    returns what consuming it would have (None, or the error), without consuming it twice, and
    `is_finished` answers from the kept outcome even while a mask fill holds the llguidance matcher."""
    compiled = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,)).compile(StructuredOutputsParams(regex="ab|ac"))
    a, b, c, x = (TOKENIZER.encode(t)[0] for t in "abcx")
    ahead, one_by_one = [compiled.new_matcher() for _ in range(4)], [compiled.new_matcher() for _ in range(4)]
    for matcher in ahead[2:] + one_by_one[2:]:
        matcher.accept(a)
    tokens = [a, x, b, x]  # allowed, refused, completes the grammar, refused after "a"
    advance_ahead(list(zip(ahead, tokens)))
    for fed, plain, token in zip(ahead, one_by_one, tokens):
        assert (fed.accept(token) is None) == (plain.accept(token) is None)
        assert fed.is_finished == plain.is_finished
    assert [m.is_finished for m in ahead] == [False, True, True, True]  # a refused token stops it too
    assert ahead[1].is_failed and not ahead[0].is_failed
    assert ahead[0].accept(c) is None  # "a" was consumed once, so "c" completes "ac"
    stray = compiled.new_matcher()
    advance_ahead([(stray, a)])
    with pytest.raises(RuntimeError, match="appended"):
        stray.accept(b)


# ------------------------------------------------------------------ forks and preemption
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["p", "qq", "r"]},
                                                    "maxItems": 3}},
          "required": ["n", "tags"], "additionalProperties": False}


def test_forked_samples_each_keep_their_own_grammar_state():
    outputs = generate({"n4": (PROMPT, _json_params(SCHEMA, 1.5, 7, n=4)),
                        "best": (PROMPT, _json_params(SCHEMA, 1.5, 8, n=2, best_of=4))})
    texts = [c.text for c in outputs["n4"].outputs]
    assert len(set(texts)) > 1  # the samples did diverge, so each matcher followed its own tokens
    for output in outputs.values():
        for completion in output.outputs:
            _assert_valid_json(completion, SCHEMA)


def test_a_forked_matcher_is_independent_of_its_parent():
    compiled = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,)).compile(StructuredOutputsParams(regex="ab|ac"))
    parent = compiled.new_matcher()
    parent.accept(TOKENIZER.encode("a")[0])
    child = parent.fork()
    assert child.accept(TOKENIZER.encode("b")[0]) is None
    assert parent.accept(TOKENIZER.encode("c")[0]) is None  # the child's "b" did not move the parent
    assert parent.is_finished and child.is_finished


def _workload() -> dict:
    requests = {}
    for i in range(8):
        prompt = TOKENIZER.encode(f"request {i}: " + "context " * (i % 3))
        requests[f"j{i}"] = (prompt, _json_params(SCHEMA, 1.0, 100 + i, n=2 if i % 4 == 0 else 1))
        requests[f"f{i}"] = (prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True))
    return requests


def _tokens(outputs: dict) -> dict:
    """Each request's completions' token ids, or its RequestError's message."""
    return {k: v.message if isinstance(v, RequestError) else [c.token_ids for c in v.outputs]
            for k, v in outputs.items()}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_every_matcher_right(mode):
    want = run_to_completion(tiny_engine(num_kv_blocks=512, max_num_batched_tokens=256), _workload())
    small = tiny_engine(num_kv_blocks=28, num_cpu_blocks=256, max_num_batched_tokens=16, preemption_mode=mode)
    got = run_to_completion(small, _workload())
    assert small.stats.num_preemptions > 0
    assert _tokens(got) == _tokens(want)
    for key, output in got.items():
        if key.startswith("j"):
            for completion in output.outputs:
                _assert_valid_json(completion, SCHEMA)


# ------------------------------------------------------------------ compile once, errors per request
def test_one_schema_compiles_once_for_many_requests():
    eng = tiny_engine()
    spellings = [SCHEMA, json.dumps(SCHEMA), json.loads(json.dumps(SCHEMA, sort_keys=True))]
    requests = {f"r{i}": (PROMPT, _json_params(spellings[i % 3], 1.0, i)) for i in range(30)}
    outputs = run_to_completion(eng, requests)
    assert eng.grammar_compiler.num_compiled == 1
    for output in outputs.values():
        _assert_valid_json(output.outputs[0], SCHEMA)


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "no-such-type"}}, "invalid structured_outputs json"),
    ({"regex": "a(b"}, "invalid structured_outputs regex"),
    ({"grammar": "root ::= (((("}, "invalid structured_outputs grammar"),
])
def test_a_bad_grammar_is_its_own_request_error_and_the_others_run(spec, message):
    eng = tiny_engine()
    bad = SamplingParams(max_tokens=5, structured_outputs=spec)
    good = SamplingParams(max_tokens=5, temperature=0.0)
    results = {}
    for request_id, params in (("good1", good), ("bad", bad), ("good2", good)):
        try:
            eng.add_request(request_id, prompt_token_ids=PROMPT, params=params)
        except ValueError as exc:  # the grammar was already known to fail
            results[request_id] = RequestError(request_id, str(exc))
    while eng.has_unfinished_requests():
        results.update({o.request_id: o for o in eng.step()})
    assert isinstance(results["bad"], RequestError) and message in results["bad"].message
    assert len(results["good1"].outputs[0].token_ids) == 5 and len(results["good2"].outputs[0].token_ids) == 5


def test_a_matcher_error_mid_generation_ends_only_its_request():
    # allowed_token_ids leaves no token the grammar accepts: the sampled token is refused by the matcher
    doomed = SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[TOKENIZER.encode("z")[0]],
                            structured_outputs={"regex": "[0-9]+"})
    outputs = generate({"doomed": (PROMPT, doomed),
                        "fine": (PROMPT, SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"regex": "[0-9]{3}"}))})
    assert isinstance(outputs["doomed"], RequestError)
    assert "structured output failed" in outputs["doomed"].message
    assert re.fullmatch("[0-9]{3}", outputs["fine"].outputs[0].text)


def test_an_aborted_request_still_compiling_leaves_nothing_behind():
    eng = tiny_engine()
    eng.add_request("r", prompt_token_ids=PROMPT,
                    params=SamplingParams(structured_outputs={"json": {"type": "object", "title": "unique-1"}}))
    assert eng.abort_request("r")
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.has_unfinished_requests()


def test_the_grammar_compiler_refuses_a_tokenizer_without_a_token_table():
    class Bare:
        def encode(self, text, add_special_tokens=True):
            return []

    compiler = GrammarCompiler(Bare(), 10, (1,))
    with pytest.raises(ValueError, match="token table"):
        compiler.compile(StructuredOutputsParams(regex="a"))
    assert isinstance(llguidance.LLTokenizer, type)


def _async_workload() -> dict:
    """Seeded JSON samples, grammars that finish early (a choice, a short regex), a request whose matcher
    fails mid-generation, and unconstrained rows beside them."""
    requests = _workload()
    requests["choice"] = (PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                 structured_outputs={"choice": ["yes", "no", "maybe"]}))
    requests["digits"] = (PROMPT, SamplingParams(max_tokens=9, temperature=0.0, structured_outputs={"regex": "[0-9]{3}"}))
    requests["doomed"] = (PROMPT, SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[TOKENIZER.encode("z")[0]],
                                                 structured_outputs={"regex": "[0-9]+"}))
    return requests


def test_async_scheduling_samples_grammar_rows_after_the_previous_step_with_the_same_tokens():
    """Under async scheduling a grammar step's forward is launched before the previous step is processed
    and its sampling after (launch_deferred_sampling); the tokens equal the sync loop's, which fills
    every mask from matchers that consumed every token first."""
    sync = run_to_completion(tiny_engine(async_scheduling=False), _async_workload())
    eng = tiny_engine(async_scheduling=True)
    deferred = []
    launch_deferred = eng.runner.launch_deferred_sampling
    eng.runner.launch_deferred_sampling = lambda launched: deferred.append(launched) or launch_deferred(launched)
    got = run_to_completion(eng, _async_workload())
    assert len(deferred) > 10  # the grammar steps took the deferred path
    assert _tokens(got) == _tokens(sync)
    assert "structured output failed" in got["doomed"].message
    assert got["choice"].outputs[0].text in ("yes", "no", "maybe")
    for key, output in got.items():
        if key.startswith("j"):
            for completion in output.outputs:
                _assert_valid_json(completion, SCHEMA)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_grammar_steps_under_preemption_give_the_sync_loop_tokens(mode):
    """The deferred mask fill with preemption in between: a grammar step launched one step ahead whose
    sequences are then preempted (recompute or swap) keeps every matcher right."""
    config = dict(num_kv_blocks=28, num_cpu_blocks=256, max_num_batched_tokens=16, preemption_mode=mode)
    sync = run_to_completion(tiny_engine(async_scheduling=False, **config), _workload())
    eng = tiny_engine(async_scheduling=True, **config)
    got = run_to_completion(eng, _workload())
    assert eng.stats.num_preemptions > 0
    assert _tokens(got) == _tokens(sync)


class GatedExecutor(Executor):
    """Runs each compile on a thread of its own once `gate` is set: a grammar that takes as long as we like."""

    def __init__(self):
        self.gate = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1)

    def submit(self, fn, *args, **kwargs):
        def gated():
            self.gate.wait(timeout=30)
            return fn(*args, **kwargs)
        return self._pool.submit(gated)

    def shutdown(self, wait=True, **kwargs):
        self.gate.set()
        self._pool.shutdown(wait=wait)


def test_a_slow_grammar_never_stalls_the_batch():
    eng = tiny_engine()
    gated = GatedExecutor()
    eng.use_grammar_executor(gated)
    eng.add_request("slow", prompt_token_ids=PROMPT,
                    params=SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"regex": "[0-9]{3}"}))
    eng.add_request("plain", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=6, temperature=0.0))
    finished = []
    while "plain" not in finished:
        finished += [o.request_id for o in eng.step()]
    assert "slow" not in finished and not eng.scheduler.running  # it waits outside the scheduler
    gated.gate.set()
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step()]
    assert finished == ["plain", "slow"]
    with pytest.raises(ValueError, match="already in use"):
        eng.use_grammar_executor(None)
    gated.shutdown()


def test_a_failed_compile_is_not_cached_and_a_good_one_is():
    compiler = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,))
    bad = StructuredOutputsParams(regex="(")
    with pytest.raises(ValueError, match="invalid structured_outputs regex"):
        compiler.compile(bad)
    with pytest.raises(ValueError, match="invalid structured_outputs regex"):
        compiler.compile(bad)
    good = StructuredOutputsParams(regex="a")
    assert compiler.compile(good) is compiler.compile(good)
    assert compiler.num_compiled == 3
