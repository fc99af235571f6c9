"""RequestProcessor (offline_paged/request_processor.py): a request -> its SequenceGroup, with the facts
derived from it computed once: scoring-only requests are marked on the group (one greedy runner token,
dropped by the engine), bad words are tokenised with their word-start forms, SamplingParams say once
whether sampling reads the token history, and only accepted requests take an arrival index (which seeds
unseeded requests), so a refused line does not change the tokens of the ones after it."""
from __future__ import annotations

import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.request_processor import RequestProcessor


class _Words:
    """'hi' and ' hi' are distinct tokens (a word-start form); 'ho' and ' ho' are the same one."""

    table = {"hi": [40], " hi": [50], "ho": [41], " ho": [41]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.table.get(text, [ord(c) % 90 for c in text])


def _processor(max_model_len: int = 16) -> RequestProcessor:
    config = EngineConfig(device="cpu", seed=7).with_device_defaults("cpu", None)  # as the engine passes it
    return RequestProcessor(config, _Words(), vocab_size=100,
                            max_model_len=max_model_len, eos_token_ids=(1,))


def test_a_scoring_only_request_is_marked_on_its_group_and_runs_one_greedy_token():
    processor = _processor(max_model_len=8)
    group = processor.process("s", None, list(range(2, 10)), SamplingParams(max_tokens=0, prompt_logprobs=1,
                                                                           temperature=0.9, seed=3))
    assert group.scoring_only  # its prompt fills max_model_len: nothing is generated
    assert (group.params.max_tokens, group.params.temperature, group.params.prompt_logprobs) == (1, 0.0, 1)
    assert not processor.process("g", None, [2, 3], SamplingParams(max_tokens=2)).scoring_only
    with pytest.raises(ValueError, match="leaves no room to generate"):
        processor.process("x", None, list(range(2, 10)), SamplingParams(max_tokens=1))


def test_bad_words_are_tokenised_with_their_distinct_word_start_forms():
    group = _processor().process("b", None, [2], SamplingParams(bad_words=["hi", " ho"]))
    assert group.params._bad_words_token_ids == ((40,), (50,), (41,))
    assert group.params.bad_words == ("hi", " ho")


@pytest.mark.parametrize("fields, penalties, history", [
    ({}, False, False), ({"repetition_penalty": 1.2}, True, True), ({"presence_penalty": 0.5}, True, True),
    ({"frequency_penalty": -0.5}, True, True), ({"bad_words": ["hi"]}, False, True),
    ({"logit_bias": {3: 1.0}, "logprobs": 2}, False, False),
])
def test_whether_sampling_reads_the_token_history_is_derived_once(fields, penalties, history):
    params = _processor().process("p", None, [2], SamplingParams(**fields)).params
    assert (params.has_penalties, params.needs_token_history) == (penalties, history)


def test_a_refused_request_takes_no_arrival_index():
    params = SamplingParams(temperature=1.0, n=2)
    with_refusal, without = _processor(), _processor()
    first = [p.process("a", None, [2, 3], params) for p in (with_refusal, without)]
    with pytest.raises(ValueError, match="prompt is empty"):
        with_refusal.process("bad", None, [], params)
    second = [p.process("b", None, [4], params) for p in (with_refusal, without)]
    assert first[0].sample_seeds == first[1].sample_seeds
    assert second[0].sample_seeds == second[1].sample_seeds != first[0].sample_seeds
    assert second[0].arrival_index == 1


def test_params_are_checked_against_the_engine():
    processor = _processor()
    assert processor.check_params(None) == SamplingParams()
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        processor.check_params({"max_tokens": 3})
    with pytest.raises(ValueError, match=r"stop_token_ids must be < the vocabulary size \(100\)"):
        processor.check_params(SamplingParams(stop_token_ids=[100]))


class _Id(int):
    """An int subclass (as an IntEnum member is): a valid id, as it always was."""


@pytest.mark.parametrize("ids, ok", [
    ([2, 3, 99], True), ([0], True), ([_Id(5), 6], True), ([2, 100], False), ([-1, 2], False),
    ([2, True], False), ([False], False), ([2, 3.0], False), (["2"], False), ([2, None], False),
])
def test_prompt_token_ids_are_integers_inside_the_vocabulary(ids, ok):
    processor = _processor()
    if ok:
        assert processor.process("p", None, ids, SamplingParams()).prompt_token_ids == list(ids)
    else:
        with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 100\)"):
            processor.process("p", None, ids, SamplingParams())


def test_numpy_ids_are_refused_as_before():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="must be integers"):
        _processor().process("p", None, list(np.arange(2, 5)), SamplingParams())
