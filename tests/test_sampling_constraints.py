"""vLLM's newer SamplingParams fields end to end on a tiny model: max_tokens=0 scoring,
prompt_logprobs_start with prefix-cache hits, logit_bias, allowed_token_ids, bad_words,
include_stop_str_in_output, truncate_prompt_tokens; and their validation."""
from __future__ import annotations

import numpy as np
import pytest
from fixtures_tiny_model import write_tiny_model

from offline_paged import LLM, SamplingParams
from offline_paged.worker.sampler import SamplingRequest, apply_penalties, apply_token_constraints

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-constraints"), seed=7)
    return LLM(str(model_dir), device="cpu", dtype="float64", block_size=4, num_kv_blocks=256)


def run(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def floats(entries):
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm):
    ids = list(range(40, 70))
    scored = run(llm, [ids], max_tokens=0, prompt_logprobs=2)
    sampled = run(llm, [ids], max_tokens=1, prompt_logprobs=2, **GREEDY)
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].text == ""
    assert floats(scored.prompt_logprobs) == floats(sampled.prompt_logprobs)


def test_a_scoring_prompt_may_fill_max_model_len(llm):
    full = [i % 200 + 3 for i in range(llm.llm_engine.max_model_len)]
    assert len(run(llm, [full], max_tokens=0, prompt_logprobs=0).prompt_logprobs) == len(full)
    with pytest.raises(ValueError, match="no room to generate"):
        run(llm, [full], max_tokens=1)


def test_prompt_logprobs_start_skips_the_cached_context_but_not_the_numbers(llm):
    context, continuation = list(range(100, 140)), list(range(10, 16))
    cold = run(llm, [context + continuation], max_tokens=0, prompt_logprobs=1)
    run(llm, [context + [3, 4]], max_tokens=0, prompt_logprobs=1)  # puts the context in the cache
    warm = run(llm, [context + continuation], max_tokens=0, prompt_logprobs=1, prompt_logprobs_start=len(context))
    assert warm.num_cached_tokens >= 36  # the context's full blocks came from the cache
    assert warm.prompt_logprobs[:len(context)] == [None] * len(context)
    for got, want in zip(floats(warm.prompt_logprobs[len(context):]), floats(cold.prompt_logprobs[len(context):]),
                         strict=True):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-9)


def test_logit_bias_and_allowed_token_ids_steer_greedy_decoding(llm):
    forced = run(llm, "ab", max_tokens=5, logit_bias={"77": 100.0}, **GREEDY)
    assert forced.outputs[0].token_ids == [77] * 5
    allowed = run(llm, "ab", max_tokens=8, allowed_token_ids=[65, 66, 67], **GREEDY)
    assert set(allowed.outputs[0].token_ids) <= {65, 66, 67}


def test_bad_words_are_never_completed(llm):
    plain = run(llm, "xy", max_tokens=12, **GREEDY).outputs[0].token_ids
    word = bytes(plain[2:4]).decode("latin-1")  # two greedy byte tokens (ids 0..255 are the bytes)
    if not word.isprintable() or word.strip() != word:
        pytest.skip("the greedy bytes do not form a plain word for this seed")
    banned = run(llm, "xy", max_tokens=12, bad_words=[word], **GREEDY).outputs[0].token_ids
    assert plain[2:4] != banned[2:4]
    assert all(banned[i:i + 2] != plain[2:4] for i in range(len(banned) - 1))


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    text = run(llm, "hello", max_tokens=16, **GREEDY).outputs[0].text
    index = next(i for i in range(2, len(text)) if text[i].isalnum() and text.find(text[i]) == i)
    cut = run(llm, "hello", max_tokens=16, stop=[text[index]], **GREEDY).outputs[0].text
    kept = run(llm, "hello", max_tokens=16, stop=[text[index]], include_stop_str_in_output=True, **GREEDY)
    assert cut == text[:index] and kept.outputs[0].text == text[:index + 1]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    out = run(llm, [list(range(20, 60))], max_tokens=2, truncate_prompt_tokens=7, **GREEDY)
    assert out.prompt_token_ids == list(range(53, 60))


def test_logit_bias_is_applied_before_the_repetition_penalty():
    """vLLM v1's order: (x + bias) / penalty for a positive biased logit of a seen token."""
    row = np.array([1.0, 2.0, -1.0])
    request = SamplingRequest(SamplingParams(logit_bias={0: 3.0}, repetition_penalty=2.0), 0, 0, [0], [])
    apply_token_constraints(row, request)
    apply_penalties(row, request)
    assert row.tolist() == [2.0, 2.0, -1.0]


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words="word"), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(detokenize=0), "detokenize"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (dict(max_tokens=0, n=2), "max_tokens=0"), (dict(prompt_logprobs_start=3), "prompt_logprobs_start"),
    (dict(stop=["x"], detokenize=False), "detokenize"),
    (dict(structured_outputs={"json": {}, "regex": "a"}), "structured outputs need exactly one of"),
    (dict(logits_processors=[print]), "logits_processors is not supported"),
])
def test_bad_values_raise_value_error_naming_the_field(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


def test_unsupported_vllm_fields_in_a_job_line_say_not_supported():
    with pytest.raises(ValueError, match="output_kind is not supported"):
        SamplingParams.from_dict({"output_kind": 1})
    assert "output_kind" not in SamplingParams().to_dict()
    assert "guided_decoding" not in SamplingParams().to_dict()  # moved into structured_outputs


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        run(llm, "a", logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        run(llm, "a", allowed_token_ids=[10**6])
