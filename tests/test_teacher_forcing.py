"""The GPU engine tests' teacher-forced comparison (tests/teacher_forcing.py), on hand-made outputs."""
from types import SimpleNamespace

import numpy as np
import pytest

from teacher_forcing import teacher_forced, top2


def _output(prompt_logprobs, logprobs, token_ids):
    return SimpleNamespace(prompt_logprobs=prompt_logprobs,
                           outputs=[SimpleNamespace(logprobs=logprobs, token_ids=token_ids)])



def test_identical_scores_agree_everywhere_with_no_error():
    prompt = [5, 6]
    entries = [None, {6: -0.1, 9: -2.0}]  # prompt position 0 scores token 1 (= 6)
    generated = [{7: -0.5, 1: -1.0}]  # the GPU drew 7 at the next position
    gpu = {"a": _output(entries, generated, [7])}
    cpu = {"a": _output([None, {6: -0.1, 9: -2.0}, {7: -0.5, 1: -1.0}], None, [])}
    result = teacher_forced({"a": prompt}, gpu, cpu, margin=0.1)
    assert result.agree.tolist() == [True, True]
    assert result.error == 0.0 and result.gpu_target.tolist() == [-0.1, -0.5]
    assert result.decisive.tolist() == [True, True]  # gaps 1.9 and 0.5 exceed 0.1 x scale 0.5


def test_a_flipped_argmax_and_a_shifted_logprob_show():
    gpu = {"a": _output([None, {6: -0.2, 9: -0.1}], [{7: -0.5, 1: -1.0}], [7])}
    cpu = {"a": _output([None, {6: -0.1, 9: -2.0}, {7: -0.5, 1: -0.52}], None, [])}
    result = teacher_forced({"a": [5, 6]}, gpu, cpu, margin=0.1)
    assert result.agree.tolist() == [False, True]
    assert result.error == pytest.approx(0.1 / 0.5)  # |-0.2 - -0.1| over the largest CPU target 0.5
    assert result.decisive.tolist() == [True, False]  # the CPU's second gap 0.02 < 0.1 x 0.5
    assert "2 positions, agreement 0.5000" in result.summary()


def test_mismatched_positions_are_an_error():
    gpu = {"a": _output([None, {6: -0.1, 9: -2.0}], [{7: -0.5, 1: -1.0}], [7])}
    cpu = {"a": _output([None, {6: -0.1, 9: -2.0}], None, [])}  # scored one position fewer
    with pytest.raises(RuntimeError, match="positions"):
        teacher_forced({"a": [5, 6]}, gpu, cpu, margin=0.1)


def test_top2_is_the_argmax_and_its_gap():
    assert top2({3: -1.0, 4: -0.25, 5: -3.0}) == (4, 0.75)
    assert np.isclose(top2({1: 0.0, 2: -1e-4})[1], 1e-4)


def test_check_refuses_too_few_decisive_positions_disagreement_and_error():
    gpu = {"a": _output([None, {6: -0.2, 9: -0.1}], [{7: -0.5, 1: -1.0}], [7])}
    cpu = {"a": _output([None, {6: -0.1, 9: -2.0}, {7: -0.5, 1: -0.52}], None, [])}
    result = teacher_forced({"a": [5, 6]}, gpu, cpu, margin=0.1)  # 1 of 2 decisive, and it disagrees; error 0.2
    with pytest.raises(AssertionError):
        result.check(least_decisive=0.6, max_error=1.0, decisive_agreement=0.0)
    with pytest.raises(AssertionError):
        result.check(least_decisive=0.4, max_error=1.0)
    with pytest.raises(AssertionError):
        result.check(least_decisive=0.4, max_error=0.1, decisive_agreement=0.0)
    result.check(least_decisive=0.4, max_error=0.3, decisive_agreement=0.0)
