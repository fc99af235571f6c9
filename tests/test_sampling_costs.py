"""SamplingParams' cost caps and vLLM's tiny-temperature rule (issue 29)."""
import pytest

from offline_paged.core.sampling_params import (MAX_BAD_WORDS, MAX_OUTPUT_ENTRIES, MAX_STOP_STRINGS,
                                                MAX_STRING_LIST_BYTES, SamplingParams)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 9.99e-6])
def test_a_temperature_below_1e_5_decodes_greedily(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.greedy


def test_a_temperature_of_1e_5_or_more_still_samples():
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_a_tiny_temperature_gives_the_greedy_tokens_not_nan():
    from tiny_engine import run_to_completion, tiny_engine, tiny_model

    model = tiny_model()
    prompt = [5, 6, 7, 8]
    outputs = {}
    for name, temperature in (("greedy", 0.0), ("tiny", 5e-324)):
        engine = tiny_engine(model)
        params = SamplingParams(max_tokens=6, temperature=temperature, ignore_eos=True, seed=3)
        outputs[name] = run_to_completion(engine, {name: (prompt, params)})[name].outputs[0].token_ids
    assert outputs["tiny"] == outputs["greedy"]


@pytest.mark.parametrize("name,cap", [("stop", MAX_STOP_STRINGS), ("bad_words", MAX_BAD_WORDS)])
def test_stop_strings_and_bad_words_are_capped_in_count_and_bytes(name, cap):
    SamplingParams(**{name: [f"w{i}" for i in range(cap)]})
    with pytest.raises(ValueError, match=rf"{name} holds {cap + 1:,} strings, over the cap of {cap:,}"):
        SamplingParams(**{name: [f"w{i}" for i in range(cap + 1)]})
    with pytest.raises(ValueError, match=rf"{name} holds [\d,]+ bytes, over the cap of {MAX_STRING_LIST_BYTES:,}"):
        SamplingParams(**{name: ["x" * (MAX_STRING_LIST_BYTES // 2 + 1)] * 2})


def test_output_entries_are_capped_with_max_tokens_bounded_by_max_model_len():
    amplified = SamplingParams(n=256, max_tokens=500, logprobs=20)  # a 104-byte line, a 74 MB record
    with pytest.raises(ValueError, match=r"= 2,688,000 is over the cap of 2,000,000"):
        amplified.check_output_cost(max_model_len=8192)
    amplified.check_output_cost(max_model_len=64)  # no sequence grows past 64 tokens
    SamplingParams(max_tokens=MAX_OUTPUT_ENTRIES).check_output_cost()
    with pytest.raises(ValueError, match="over the cap"):
        SamplingParams(best_of=2, max_tokens=MAX_OUTPUT_ENTRIES).check_output_cost()


def test_a_non_list_bad_words_message_is_short():
    with pytest.raises(ValueError) as info:
        SamplingParams(bad_words="x" * 1_000_000)
    assert len(str(info.value)) < 200
