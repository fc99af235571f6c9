"""StopChecker: vLLM's order of stop checks, stop strings in incrementally decoded text, the final text."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_engine import EOS_ID, ByteTokenizer

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup
from offline_paged.core.stop_checker import StopChecker

PROMPT = [10, 11, 12]
TOKENIZER = ByteTokenizer()


def _seq(**params) -> Sequence:
    group = SequenceGroup("r", 0, None, list(PROMPT), SamplingParams(**params), [0])
    return Sequence(0, group, 0, 0, list(PROMPT), len(PROMPT))


def _feed(checker: StopChecker, seq: Sequence, tokens: list[int]) -> list:
    """Append tokens one at a time as the output processor does; the decisions, up to the first stop."""
    decisions = []
    for token in tokens:
        seq.token_ids.append(token)
        decisions.append(checker(seq))
        if decisions[-1] is not None:
            break
    return decisions


def _bytes(text: str) -> list[int]:
    return TOKENIZER.encode(text)


@pytest.fixture
def checker() -> StopChecker:
    return StopChecker(TOKENIZER, (EOS_ID,), max_model_len=64)


def test_eos_stops_and_is_recorded(checker):
    seq = _seq(max_tokens=10)
    assert _feed(checker, seq, _bytes("ab") + [EOS_ID]) == [None, None, (FinishReason.STOP, EOS_ID)]
    assert seq.finished_by_eos


def test_ignore_eos_runs_to_max_tokens(checker):
    seq = _seq(max_tokens=3, ignore_eos=True)
    assert _feed(checker, seq, [EOS_ID, EOS_ID, EOS_ID]) == [None, None, (FinishReason.LENGTH, None)]
    assert not seq.finished_by_eos


def test_a_stop_token_id_stops_even_when_eos_is_ignored(checker):
    seq = _seq(max_tokens=10, ignore_eos=True, stop_token_ids=[EOS_ID])
    assert _feed(checker, seq, _bytes("a") + [EOS_ID]) == [None, (FinishReason.STOP, EOS_ID)]
    assert not seq.finished_by_eos


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings_but_not_the_length_limit(checker):
    # min_tokens=4: the first three outputs are never checked for EOS, stop ids or stop strings.
    seq = _seq(max_tokens=5, min_tokens=4, stop_token_ids=[_bytes("x")[0]], stop=["y"])
    decisions = _feed(checker, seq, [EOS_ID] + _bytes("xy") + [EOS_ID])
    assert decisions == [None, None, None, (FinishReason.STOP, EOS_ID)]
    tight = StopChecker(TOKENIZER, (EOS_ID,), max_model_len=len(PROMPT) + 2)
    short = _seq(max_tokens=10, min_tokens=5)
    assert _feed(tight, short, [EOS_ID, EOS_ID]) == [None, (FinishReason.LENGTH, None)]


def test_text_seen_during_min_tokens_still_counts_for_a_later_stop_string(checker):
    # "ab" arrives while min_tokens holds checks back; the stop string "abc" completes with the third.
    seq = _seq(max_tokens=10, min_tokens=3, stop=["abc"])
    assert _feed(checker, seq, _bytes("abc")) == [None, None, (FinishReason.STOP, "abc")]
    assert checker.final_text(seq) == ""


def test_max_model_len_is_a_length_stop(checker):
    seq = _seq(max_tokens=1000, ignore_eos=True)
    decisions = _feed(checker, seq, [20] * 100)
    assert decisions[-1] == (FinishReason.LENGTH, None)
    assert seq.num_known_tokens == 64


def test_a_pending_token_does_not_count_towards_max_tokens(checker):
    seq = _seq(max_tokens=2)
    seq.num_pending_tokens = 1  # a lookahead step's token, not known yet
    assert _feed(checker, seq, _bytes("a")) == [None]
    assert _feed(checker, seq, _bytes("b")) == [(FinishReason.LENGTH, None)]


def test_the_earliest_stop_string_wins_and_the_text_ends_before_it(checker):
    seq = _seq(max_tokens=50, stop=["cd", "bcd"])
    decisions = _feed(checker, seq, _bytes("abcdef"))
    assert decisions[-1] == (FinishReason.STOP, "bcd") and len(decisions) == 4
    assert checker.final_text(seq) == "a"


def test_include_stop_str_in_output_keeps_the_stop_string(checker):
    seq = _seq(max_tokens=50, stop=["cd"], include_stop_str_in_output=True)
    _feed(checker, seq, _bytes("abcdef"))
    assert checker.final_text(seq) == "abcd"


def test_final_text_without_a_stop_string_decodes_the_output_and_detokenize_false_gives_none(checker):
    seq = _seq(max_tokens=3)
    _feed(checker, seq, _bytes("hé"))  # three byte tokens
    assert checker.final_text(seq) == "hé"
    quiet = _seq(max_tokens=3, detokenize=False)
    _feed(checker, quiet, _bytes("hé"))
    assert checker.final_text(quiet) == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc€ ", min_size=1, max_size=20), stop=st.text(alphabet="abc€ ", min_size=1, max_size=3))
def test_stop_strings_match_a_search_of_the_whole_text(text, stop):
    """Fed byte by byte, the checker stops exactly at the byte that completes the first occurrence of
    `stop`, and the text ends just before it; without an occurrence it runs to the end."""
    checker = StopChecker(TOKENIZER, (EOS_ID,), max_model_len=1000)
    seq = _seq(max_tokens=1000, stop=[stop])
    decisions = _feed(checker, seq, _bytes(text))
    index = text.find(stop)
    if index < 0:
        assert all(d is None for d in decisions)
        assert checker.final_text(seq) == text
    else:
        assert decisions[-1] == (FinishReason.STOP, stop)
        assert len(decisions) == len(text[:index + len(stop)].encode())
        assert checker.final_text(seq) == text[:index]
