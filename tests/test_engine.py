"""LLMEngine / LLM end to end on a tiny random model: agreement with an independent greedy path,
logprobs consistent with the logits, determinism, stop conditions, validation, abort."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_engine import EOS_ID, ByteTokenizer, run_to_completion, tiny_engine, tiny_model

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup
from offline_paged.core.stop_checker import StopChecker
from offline_paged.entrypoints.llm import LLM
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.ops_numpy import NumpyOps
from offline_paged.worker.sampler import log_softmax

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 260, size=n).tolist() for n in lengths]


def simple_runner(model) -> SimpleRunner:
    llama = Llama(model.config, model.weights, NumpyOps(), np.float64)
    return SimpleRunner(llama, num_blocks=256, block_size=4)


def test_greedy_matches_the_simple_runner():
    model = tiny_model()
    batch = prompts(0, [5, 17, 33, 2, 9])
    want = simple_runner(model).greedy(batch, max_new_tokens=12)
    engine = tiny_engine(model, max_num_batched_tokens=24)  # chunked prefill mixed with decodes
    got = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=12, **GREEDY))
                                     for i, p in enumerate(batch)})
    assert [got[str(i)].outputs[0].token_ids for i in range(len(batch))] == want


def test_logprobs_match_the_logits():
    model = tiny_model()
    prompt = prompts(1, [11])[0]
    engine = tiny_engine(model)
    out = run_to_completion(engine, {"a": (prompt, SamplingParams(max_tokens=6, logprobs=3, **GREEDY))})["a"]
    completion = out.outputs[0]
    logits = simple_runner(model).step([(0, prompt + completion.token_ids[:-1])], all_logits=True)[0]
    expected = log_softmax(logits[len(prompt) - 1:])  # [6, V]
    for row, token, entry in zip(expected, completion.token_ids, completion.logprobs):
        top3 = np.argsort(-row)[:3]
        assert set(entry) == set(top3.tolist()) | {token}
        for token_id, value in entry.items():
            assert value == pytest.approx(row[token_id], abs=1e-9)
    assert completion.cumulative_logprob == pytest.approx(
        sum(row[t] for row, t in zip(expected, completion.token_ids)), abs=1e-8)


def test_prompt_logprobs_are_computed_even_for_cached_prefixes():
    model = tiny_model()
    prompt = prompts(2, [23])[0]
    logits = simple_runner(model).step([(0, prompt)], all_logits=True)[0]
    expected = log_softmax(logits)  # [23, V]
    engine = tiny_engine(model)
    params = SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY)
    first = run_to_completion(engine, {"first": (prompt, params)})["first"]
    second = run_to_completion(engine, {"second": (prompt, params)})["second"]
    assert second.num_cached_tokens > 0, "the second request should hit the prefix cache"
    for out in (first, second):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert prompt[pos] in entry
            assert entry[prompt[pos]] == pytest.approx(expected[pos - 1, prompt[pos]], abs=1e-9)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_seeded_request_is_the_same_in_any_batch_and_pool():
    model = tiny_model()
    target = (prompts(3, [14])[0], SamplingParams(temperature=0.8, top_k=50, seed=1234, max_tokens=20))
    alone = run_to_completion(tiny_engine(model), {"t": target})["t"].outputs[0].token_ids
    crowd = {f"c{i}": (p, SamplingParams(temperature=1.0, max_tokens=15))
             for i, p in enumerate(prompts(4, [30, 7, 19, 25, 3]))}
    crowded = run_to_completion(tiny_engine(model, num_kv_blocks=28, max_num_batched_tokens=12),
                                {**crowd, "t": target})
    assert crowded["t"].outputs[0].token_ids == alone


def test_stop_token_ids_and_min_tokens():
    model = tiny_model()
    prompt = prompts(5, [9])[0]
    free = run_to_completion(tiny_engine(model), {"a": (prompt, SamplingParams(max_tokens=16, **GREEDY))})
    tokens = free["a"].outputs[0].token_ids
    stop_token = tokens[5]
    first = tokens.index(stop_token)
    out = run_to_completion(tiny_engine(model), {"a": (prompt, SamplingParams(
        max_tokens=16, stop_token_ids=[stop_token], **GREEDY))})["a"].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert (out.finish_reason, out.stop_reason, out.finished_by_eos) == ("stop", stop_token, False)
    late = run_to_completion(tiny_engine(model), {"a": (prompt, SamplingParams(
        max_tokens=16, min_tokens=first + 2, stop_token_ids=[stop_token], **GREEDY))})["a"].outputs[0]
    assert stop_token not in late.token_ids[:first + 2]


def test_eos_stops_unless_ignored():
    base = tiny_model()
    prompt = prompts(6, [8])[0]
    tokens = run_to_completion(tiny_engine(base), {"a": (prompt, SamplingParams(max_tokens=10, **GREEDY))})
    eos = tokens["a"].outputs[0].token_ids[3]
    model = dataclasses.replace(base, config=dataclasses.replace(base.config, eos_token_ids=(eos,)))
    stopped = run_to_completion(tiny_engine(model), {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=10))})
    out = stopped["a"].outputs[0]
    assert out.token_ids[-1] == eos and out.finished_by_eos and out.finish_reason == "stop"
    ignored = run_to_completion(tiny_engine(model), {"a": (prompt, SamplingParams(max_tokens=10, **GREEDY))})
    assert len(ignored["a"].outputs[0].token_ids) == 10
    assert ignored["a"].outputs[0].finish_reason == "length"


def test_max_model_len_ends_with_length():
    engine = tiny_engine(max_model_len=20)
    out = run_to_completion(engine, {"a": (prompts(7, [15])[0], SamplingParams(max_tokens=50, **GREEDY))})
    assert len(out["a"].outputs[0].token_ids) == 5 and out["a"].outputs[0].finish_reason == "length"


def test_stop_string_cut_from_the_text():
    model = tiny_model()
    llm = LLM(device="cpu", dtype="float64", loaded_model=model, block_size=4, num_kv_blocks=128)
    text = llm.generate("ab", SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].text
    # A two-character stop string from the middle of the greedy text (no replacement chars in it).
    index = next(i for i in range(3, len(text) - 1)
                 if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    stop = text[index:index + 2]
    out = llm.generate("ab", SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:index]


def _scripted_seq(stop):
    group = SequenceGroup("s", 0, None, [10], SamplingParams(stop=stop, max_tokens=50), [0])
    return Sequence(0, group, 0, 0, [10], 1)


def test_stop_string_never_cuts_a_character():
    tokenizer = ByteTokenizer()
    checker = StopChecker(tokenizer, (EOS_ID,), max_model_len=100)
    euro = [b + 4 for b in "€".encode()]  # three byte tokens
    seq = _scripted_seq(["€"])
    decisions = []
    for token in tokenizer.encode("ab") + euro + tokenizer.encode("c"):
        seq.token_ids.append(token)
        decisions.append(checker(seq))
    assert decisions[:4] == [None] * 4  # "a", "b" and the first two bytes of "€": no stop yet
    assert decisions[4] == (FinishReason.STOP, "€")
    assert checker.final_text(seq) == "ab"


def test_best_of_returns_the_n_most_likely():
    out = run_to_completion(tiny_engine(), {"a": (prompts(8, [6])[0], SamplingParams(
        n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))})["a"]
    assert [c.index for c in out.outputs] == [0, 1]
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_token_ids=[]), "empty"),
    (dict(prompt_token_ids=[5] * 600), "max_model_len"),
    (dict(prompt_token_ids=[999]), r"\[0, 260\)"),
    (dict(prompt_token_ids=[5], params=SamplingParams(use_beam_search=True, temperature=0.0,
                                                      repetition_penalty=1.1)), "repetition_penalty"),
    (dict(prompt_token_ids=[5], params=SamplingParams(n=17)), "max_num_seqs"),
    (dict(prompt_token_ids=[5], params=SamplingParams(best_of=1024)), "max_num_seqs"),
    (dict(prompt_token_ids=[5], params=SamplingParams(stop_token_ids=[260], min_tokens=1)),
     r"stop_token_ids must be < the vocabulary size \(260\)"),
    (dict(prompt_token_ids=[5], params=SamplingParams(logprobs=21)), r"max_logprobs \(20\)"),
    (dict(prompt_token_ids=[5], params=SamplingParams(prompt_logprobs=10**6)), "max_logprobs"),
    (dict(), "prompt"),
])
def test_add_request_rejects_misuse(kwargs, message):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", **kwargs)
    assert not engine.has_unfinished_requests()


def test_max_logprobs_is_an_engine_setting():
    engine = tiny_engine(max_logprobs=30)
    engine.add_request("x", prompt_token_ids=[5], params=SamplingParams(logprobs=30, max_tokens=1))
    (out,) = engine.step()
    assert len(out.outputs[0].logprobs[0]) >= 30


def test_stop_token_id_past_the_vocabulary_never_reaches_a_step():
    engine = tiny_engine()
    engine.add_request("ok", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(ValueError):
        engine.add_request("bad", prompt_token_ids=[5], params=SamplingParams(
            stop_token_ids=[10**6], min_tokens=1, max_tokens=3))
    results = run_to_completion(engine, {})
    assert list(results) == ["ok"] and len(results["ok"].outputs[0].token_ids) == 3


def test_duplicate_request_id_is_rejected():
    engine = tiny_engine()
    engine.add_request("x", prompt_token_ids=[5, 6])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompt_token_ids=[7])


def test_abort_frees_the_blocks():
    engine = tiny_engine()
    engine.add_request("keep", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("drop", prompt_token_ids=list(range(4, 40)), params=SamplingParams(max_tokens=30, **GREEDY))
    engine.step()
    assert engine.abort_request("drop") and not engine.abort_request("drop")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step()]
    assert finished == ["keep"]
    assert engine.block_manager.num_seqs == 0


def test_llm_generate_keeps_input_order_and_accepts_every_prompt_form():
    llm = LLM(device="cpu", dtype="float64", loaded_model=tiny_model(), block_size=4, num_kv_blocks=128)
    outs = llm.generate(["a long prompt first", [5, 6], {"prompt_token_ids": [7, 8], "prompt": "x"},
                         {"prompt": "q"}], SamplingParams(max_tokens=3, **GREEDY))
    assert [o.prompt for o in outs] == ["a long prompt first", None, "x", "q"]
    assert outs[1].prompt_token_ids == [5, 6] and outs[2].prompt_token_ids == [7, 8]
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, **GREEDY))
    assert chat[0].prompt == "<user>hi\n<assistant>" and len(chat[0].outputs[0].token_ids) == 3
