"""Beam search under a grammar on the tiny random model: the engine's beams equal a textbook beam search
over the allowed tokens only (and, where the beams are wide enough, the exhaustive ranking of every output
the grammar allows, scored by teacher forcing); every beam satisfies its grammar; child beams fork their
parent's matcher and never share one; a beam left without a candidate is dropped, and only a request left
with nothing fails; preemption, the prefix cache and async scheduling change nothing."""
from __future__ import annotations

import functools
import itertools
import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_beam_search import ModelLogprobs
from tiny_engine import EOS_ID, VOCAB_SIZE, ByteTokenizer, run_to_completion, tiny_engine, tiny_model

from offline_paged.core.beam_search import BeamState
from offline_paged.core.grammar_compiler import GrammarCompiler
from offline_paged.core.outputs import RequestError
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.scheduler import Scheduler
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from offline_paged.core.structured_matcher import fill_bitmask_rows
from offline_paged.core.structured_outputs import StructuredOutputsParams
from offline_paged.worker.sampler import SampleResult, Sampler, SamplingRequest, log_softmax, unpack_bitmask

TOKENIZER = ByteTokenizer()
PROMPT = TOKENIZER.encode("Answer: ")
COLORS = ["red", "green", "gr", "blue", "grey"]  # "gr" is a prefix of two others: it ends with EOS
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "mm", "l"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 40}},
          "required": ["ok", "size", "n"], "additionalProperties": False}


def beam(width: int, n: int | None = None, spec=None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 80)
    return SamplingParams(use_beam_search=True, temperature=0.0, n=n or width, best_of=width,
                          structured_outputs=spec, **kwargs)


@functools.cache
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,))


@functools.cache
def model_logprobs() -> ModelLogprobs:
    return ModelLogprobs(tiny_model())


def allowed_tokens(matcher) -> list[int]:
    mask = np.zeros((1, matcher.num_words), dtype=np.int32)  # [1, W]
    fill_bitmask_rows([(matcher, 0)], mask)
    return unpack_bitmask(mask, VOCAB_SIZE)[0].nonzero()[0].tolist()


def advanced(matcher, token: int):
    child = matcher.fork()
    assert child.accept(token) is None
    return child


def score(prompt: list[int], out: list[int], cum: float) -> float:
    """beam_search.beam_score: cum / length, a final EOS not counted."""
    return cum / (len(prompt) + len(out) - (out[-1] == EOS_ID))


def every_output(spec: dict) -> list[list[int]]:
    """Every output the grammar allows, by a walk over the matcher's masks with the stop checker's rules:
    EOS ends an output where the grammar accepts, a completed grammar ends it."""
    outputs = []

    def walk(matcher, out: list[int]) -> None:
        for token in allowed_tokens(matcher):
            child = advanced(matcher, token)
            if token == EOS_ID or child.is_finished:
                outputs.append(out + [token])
            else:
                walk(child, out + [token])

    walk(compiler().compile(StructuredOutputsParams.from_dict(spec)).new_matcher(), [])
    return outputs


def teacher_forced(prompt: list[int], out: list[int]) -> float:
    """The model's cumulative log-probability of `out` after `prompt`, one fresh forward per position."""
    return float(sum(model_logprobs()(prompt + out[:i])[token] for i, token in enumerate(out)))


def reference_beam_search(prompt: list[int], spec: dict, width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    """Textbook beam search over the allowed tokens of each beam (no early stop): the best 2·width
    (beam, token) pairs by cumulative logprob; EOS, a completed grammar or max_tokens end a hypothesis;
    the best `width` unfinished pairs carry on, each with its own matcher. (output ids, cum), best first."""
    beams = [([], 0.0, compiler().compile(StructuredOutputsParams.from_dict(spec)).new_matcher())]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        candidates = []
        for order, (out, cum, matcher) in enumerate(beams):
            row = model_logprobs()(prompt + out)  # [V]
            candidates += [(cum + row[t], order, t, out, matcher) for t in allowed_tokens(matcher)]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = []
        for cum, _, token, out, matcher in candidates[:2 * width]:
            child = advanced(matcher, token)
            if token == EOS_ID or child.is_finished or len(out) + 1 == max_tokens:
                finished.append((out + [token], cum))
            elif len(beams) < width:
                beams.append((out + [token], cum, child))
        finished = sorted(finished, key=lambda h: score(prompt, *h), reverse=True)[:width]
        if not beams:
            break
    return finished


def completions(output) -> list[tuple[list[int], float]]:
    return [(c.token_ids, c.cumulative_logprob) for c in output.outputs]


def assert_same_beams(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    np.testing.assert_allclose([c for _, c in got], [c for _, c in want], rtol=0, atol=1e-9)


def satisfies(spec: dict, text: str) -> bool:
    if "choice" in spec:
        return text in spec["choice"]
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    jsonschema.validate(json.loads(text), spec["json"])
    return True


# ------------------------------------------------------------------ exact beams
@pytest.mark.parametrize("spec", [
    {"choice": COLORS},
    {"regex": "[ab]c?"},  # "a" and "b" accept and continue: EOS is a candidate there
    {"json": SCHEMA | {"properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "mm"]}},
                       "required": ["ok", "size"]}, "disable_any_whitespace": True},
], ids=["choice", "regex", "json"])
def test_wide_beams_return_every_allowed_output_ranked_by_its_teacher_forced_score(spec):
    outputs = every_output(spec)
    assert 4 <= len(outputs) <= 6
    width = len(outputs) + 1
    got = run_to_completion(tiny_engine(), {"b": (PROMPT, beam(width, spec=spec))})["b"]
    want = sorted(((out, teacher_forced(PROMPT, out)) for out in outputs),
                  key=lambda h: score(PROMPT, *h), reverse=True)
    assert_same_beams(completions(got), want)
    texts = [c.text for c in got.outputs]
    assert len(set(texts)) == len(texts) and all(satisfies(spec, t) for t in texts)
    assert all(c.finish_reason == "stop" for c in got.outputs)
    if "choice" in spec:
        assert sorted(texts) == sorted(COLORS)


@pytest.mark.parametrize("spec, width, n", [
    ({"choice": COLORS}, 2, 2),
    ({"regex": "(ab|c)[0-9]{1,2}"}, 3, 2),
    ({"json": SCHEMA, "disable_any_whitespace": True}, 3, 3),
    ({"grammar": 'root ::= "yes" | "no" " " [0-9]'}, 2, 1),
], ids=["choice", "regex", "json", "gbnf"])
def test_narrow_beams_equal_a_textbook_beam_search_over_the_allowed_tokens(spec, width, n):
    got = run_to_completion(tiny_engine(), {"b": (PROMPT, beam(width, n, spec=spec))})["b"]
    want = reference_beam_search(PROMPT, spec, width, 80)[:n]
    assert_same_beams(completions(got), want)
    for c in got.outputs:
        assert c.finish_reason == "stop"
        assert "grammar" in spec or satisfies(spec, c.text)


def test_the_logprobs_shown_for_a_grammar_beam_are_its_best_allowed_tokens_with_raw_values():
    spec = {"regex": "(ab|c)[0-9]{1,2}"}
    got = run_to_completion(tiny_engine(), {"b": (PROMPT, beam(3, spec=spec, logprobs=2))})["b"]
    for c in got.outputs:
        matcher = compiler().compile(StructuredOutputsParams.from_dict(spec)).new_matcher()
        for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = model_logprobs()(PROMPT + c.token_ids[:pos])  # [V]
            allowed = allowed_tokens(matcher)
            best = sorted(allowed, key=lambda t: -row[t])[:2]
            assert set(entry) == set(best) | {token}
            np.testing.assert_allclose([entry[t] for t in entry], row[list(entry)], rtol=0, atol=1e-9)
            if token != EOS_ID:
                matcher = advanced(matcher, token)


# ------------------------------------------------------------------ every beam satisfies its grammar
_LEAVES = st.one_of(
    st.lists(st.text("abz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "boolean"}),
    st.integers(-20, 20).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 15}),
    st.integers(0, 2).map(lambda n: {"type": "string", "maxLength": n}),
)
_VALUES = st.one_of(_LEAVES, st.tuples(_LEAVES, st.integers(0, 2)).map(
    lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}))
SCHEMAS = st.dictionaries(st.sampled_from(["a", "id", "x_1"]), _VALUES, min_size=1, max_size=2).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
_PIECES = st.tuples(st.sampled_from(["a", "b", "0", "-", "[a-c]", "[0-9]"]),
                    st.sampled_from(["", "?", "{1,3}", "{2}"])).map("".join)
REGEXES = st.lists(st.lists(_PIECES, min_size=1, max_size=3).map("".join), min_size=1, max_size=3).map("|".join)
SPECS = st.one_of(SCHEMAS.map(lambda s: {"json": s, "disable_any_whitespace": True}),
                  REGEXES.map(lambda r: {"regex": r}))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=SPECS, width=st.integers(1, 4))
def test_every_beam_satisfies_its_grammar_and_equals_the_reference(spec, width):
    got = run_to_completion(tiny_engine(), {"b": (PROMPT, beam(width, spec=spec, max_tokens=120))})["b"]
    want = reference_beam_search(PROMPT, spec, width, 120)
    assert_same_beams(completions(got), want)
    texts = [c.text for c in got.outputs]
    assert len(set(map(tuple, (c.token_ids for c in got.outputs)))) == len(texts)  # distinct hypotheses
    for c in got.outputs:
        assert c.finish_reason == "stop", c.text
        assert satisfies(spec, c.text), (spec, c.text)


def test_without_the_grammar_the_beams_would_not_have_satisfied_it():
    """The property tests can fail: unconstrained, the beams of the same request are not in the list."""
    got = run_to_completion(tiny_engine(), {"b": (PROMPT, beam(3, max_tokens=5))})["b"]
    assert not any(c.text in COLORS for c in got.outputs)


# ------------------------------------------------------------------ forks own their matchers
def _grammar_group(spec: dict, width: int) -> tuple[BeamState, list[Sequence]]:
    params = beam(width, spec=spec)
    state = BeamState(beam_width=width, max_len=len(PROMPT) + params.max_tokens)
    group = SequenceGroup("r", 0, None, PROMPT, params, [0], beam=state)
    matcher = compiler().compile(params.structured_outputs).new_matcher()
    first = Sequence(0, group, 0, 0, list(PROMPT), len(PROMPT), status=SequenceStatus.RUNNING, matcher=matcher)
    group.seqs.append(first)
    return state, group.seqs


def _grammar_stop(seq: Sequence):
    """The stop checker's grammar rules alone: feed the matcher, stop where it refuses or completes."""
    seq.error = seq.matcher.accept(seq.token_ids[-1])
    if seq.error is not None:
        return FinishReason.ABORT, None
    return (FinishReason.STOP, None) if seq.matcher.is_finished else None


def test_each_child_beam_gets_its_own_fork_of_its_parents_matcher():
    state, live = _grammar_group({"choice": ["ab", "ac", "bd"]}, 3)
    a, b = TOKENIZER.encode("a")[0], TOKENIZER.encode("b")[0]
    state.add_result(live[0], SampleResult(a, -0.5, {a: -0.5, b: -0.7}))
    step = state.step(live, _grammar_stop, itertools.count(1).__next__)
    children = [child for child, _ in step.children]
    assert [c.token_ids[-1] for c in children] == [a, b]
    parent_matcher = live[0].matcher
    assert len({id(parent_matcher), *(id(c.matcher) for c in children)}) == 3  # never shared
    assert allowed_tokens(parent_matcher) == [a, b]  # the children's tokens did not move the parent
    assert allowed_tokens(children[0].matcher) == TOKENIZER.encode("bc")  # after "a": "ab" or "ac"
    assert allowed_tokens(children[1].matcher) == TOKENIZER.encode("d")


def test_no_two_live_beams_ever_hold_the_same_matcher():
    eng = tiny_engine()
    eng.add_request("b", prompt_token_ids=PROMPT, params=beam(4, spec={"json": SCHEMA, "disable_any_whitespace": True}))
    holders: dict[int, tuple[object, int]] = {}  # id(matcher) -> (the matcher, kept alive; its sequence's id)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            matcher, owner = holders.setdefault(id(seq.matcher), (seq.matcher, seq.seq_id))
            assert owner == seq.seq_id, f"beams {owner} and {seq.seq_id} share a matcher"
        steps += 1
    assert steps > 10 and len(holders) > 20


# ------------------------------------------------------------------ dead ends
def test_a_beam_whose_grammar_leaves_no_candidate_is_dropped_and_its_sibling_carries_on():
    # Before min_tokens=2 the stop id "b" is banned: the beam "a" (only "b" may follow) has no candidate.
    b = TOKENIZER.encode("b")[0]
    got = run_to_completion(tiny_engine(), {"d": (PROMPT, beam(2, 1, {"regex": "(ab|cd)e"}, min_tokens=2,
                                                                stop_token_ids=[b]))})["d"]
    assert [c.text for c in got.outputs] == ["cde"]


def test_a_request_left_with_no_beam_and_no_hypothesis_is_an_error_and_the_others_run():
    ab = TOKENIZER.encode("ab")
    got = run_to_completion(tiny_engine(), {
        "dead": (PROMPT, beam(2, spec={"regex": "[ab]x"}, min_tokens=1, stop_token_ids=ab)),
        "fine": (PROMPT, beam(2, spec={"choice": COLORS})),
    })
    assert isinstance(got["dead"], RequestError)
    assert "no beam is left" in got["dead"].message and "min_tokens=1" in got["dead"].message
    assert {c.text for c in got["fine"].outputs} <= set(COLORS)


def test_an_empty_row_drops_a_grammar_beam_but_is_a_runner_bug_without_a_grammar():
    state, live = _grammar_group({"choice": ["ab", "ac", "bd"]}, 2)
    a, b = TOKENIZER.encode("ab")
    state.add_result(live[0], SampleResult(a, -0.5, {a: -0.5, b: -0.7}))
    step = state.step(live, _grammar_stop, itertools.count(1).__next__)
    live = [child for child, _ in step.children]
    state.add_result(live[0], SampleResult(b, -0.1, {}))  # "a": its grammar left nothing
    state.add_result(live[1], SampleResult(TOKENIZER.encode("d")[0], -0.2, {TOKENIZER.encode("d")[0]: -0.2}))
    step = state.step(live, _grammar_stop, itertools.count(10).__next__)
    assert [h.token_ids[-2:] for h in state.hypotheses] == [TOKENIZER.encode("bd")] and step.done
    assert state.error is None
    live[0].matcher = None
    state.add_result(live[0], SampleResult(b, -0.1, {}))
    state.add_result(live[1], SampleResult(b, -0.1, {b: -0.1}))
    with pytest.raises(RuntimeError, match="no top logprobs"):
        state.step(live, _grammar_stop, itertools.count(20).__next__)


# ------------------------------------------------------------------ the sampler's rows
def test_a_beam_row_under_a_grammar_ranks_only_its_allowed_tokens():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, VOCAB_SIZE)).astype(np.float32)  # [R, V]
    bits = np.zeros((4, VOCAB_SIZE), dtype=bool)  # [R, V]
    bits[0, [7, 30, 200]] = True  # fewer allowed tokens than k
    bits[1, rng.choice(VOCAB_SIZE, 40, replace=False)] = True
    bits[3, 5] = True  # a row of a plain (not beam) request: the raw top-k, disallowed tokens included
    masks = np.packbits(np.pad(bits, ((0, 0), (0, 28))), axis=1, bitorder="little").view(np.int32)  # [R, W]
    beam_params = SamplingParams(use_beam_search=True, temperature=0.0, n=2, logprobs=6)
    requests = [SamplingRequest(beam_params, 0, 0, (), (), masks[r]) for r in range(3)]
    requests.append(SamplingRequest(SamplingParams(temperature=0.0, logprobs=6), 0, 0, (), (), masks[3]))
    results = Sampler((EOS_ID,)).sample(logits, requests)
    raw = log_softmax(logits)  # [R, V]
    for r in (0, 1):
        allowed = np.flatnonzero(bits[r])
        best = allowed[np.argsort(-raw[r, allowed])][:6]
        assert list(results[r].top_logprobs) == best.tolist()
        np.testing.assert_array_equal(list(results[r].top_logprobs.values()), raw[r, best])
    assert results[2].top_logprobs == {}  # nothing allowed: no candidate at all
    assert set(results[3].top_logprobs) == set(np.argsort(-raw[3])[:6].tolist()) | {5}  # + the chosen token


# ------------------------------------------------------------------ preemption, prefix cache, async
def _workload() -> dict:
    shared = TOKENIZER.encode("Shared context for every request. ")
    json_spec = {"json": SCHEMA, "disable_any_whitespace": True}
    requests = {f"j{i}": (shared + TOKENIZER.encode(f"item {i}: "), beam(2 + i % 3, 1 + i % 2, json_spec))
                for i in range(4)}
    requests["c"] = (shared + PROMPT, beam(3, spec={"choice": COLORS}))
    requests["r"] = (shared + PROMPT, beam(4, 2, {"regex": "(ab|c)[0-9]{1,2}"}))
    requests["g"] = (shared + PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    requests["s"] = (PROMPT, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=60, structured_outputs=json_spec))
    return requests


def _summary(outputs: dict) -> dict:
    return {k: v.message if isinstance(v, RequestError) else [(c.token_ids, c.finish_reason) for c in v.outputs]
            for k, v in outputs.items()}


def _cumulative(outputs: dict) -> np.ndarray:
    return np.array([c.cumulative_logprob for _, v in sorted(outputs.items()) for c in v.outputs])


def assert_same_outputs(got: dict, want: dict) -> None:
    assert _summary(got) == _summary(want)
    np.testing.assert_allclose(_cumulative(got), _cumulative(want), rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def ample():
    eng = tiny_engine(num_kv_blocks=1024, max_num_batched_tokens=256)
    outputs = run_to_completion(eng, _workload())
    assert eng.stats.num_preemptions == 0
    assert not any(isinstance(v, RequestError) for v in outputs.values())
    return outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_beams(ample, mode, monkeypatch):
    parks = []  # idle beams parked: their rows (masked by their grammar) wait while their blocks are freed
    park = Scheduler._park
    monkeypatch.setattr(Scheduler, "_park", lambda self, seq: (parks.append(seq.seq_id), park(self, seq)))
    eng = tiny_engine(num_kv_blocks=26, num_cpu_blocks=512, max_num_batched_tokens=16, preemption_mode=mode)
    got = run_to_completion(eng, _workload())
    assert eng.stats.num_preemptions > 0 and parks
    if mode == "swap":
        assert eng.stats.num_preemptions_swap > 0
    assert_same_outputs(got, ample)
    assert eng.block_manager.num_seqs == 0 and eng.block_manager.num_free_blocks == eng.num_gpu_blocks


@pytest.mark.parametrize("config", [dict(enable_prefix_caching=False), dict(async_scheduling=True)],
                         ids=["no-prefix-cache", "async"])
def test_the_prefix_cache_and_async_scheduling_change_no_beam(ample, config):
    eng = tiny_engine(num_kv_blocks=1024, max_num_batched_tokens=256, **config)
    assert_same_outputs(run_to_completion(eng, _workload()), ample)
