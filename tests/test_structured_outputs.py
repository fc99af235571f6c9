"""StructuredOutputsParams and its place in SamplingParams: vLLM's spellings, validation, the cache key."""
import pickle

import pytest

from offline_paged import GuidedDecodingParams, SamplingParams, StructuredOutputsParams


def test_exactly_one_constraint_is_required():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize("kwargs, message", [
    ({"json": "{not json"}, "not JSON"),
    ({"json": 3}, "JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"regex": 5}, "non-empty string"),
    ({"choice": "ab"}, "list of strings"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty list"),
    ({"grammar": ""}, "non-empty string"),
    ({"json_object": 1}, "true or false"),
    ({"json": {}, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
])
def test_bad_values_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_two_spellings_of_one_schema_share_one_key():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key and a == b
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key
    assert a.schema == {"type": "object", "properties": {"x": {"type": "integer"}}}


def test_guided_decoding_is_the_older_name_of_structured_outputs():
    assert GuidedDecodingParams is StructuredOutputsParams
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert params.structured_outputs == StructuredOutputsParams(choice=("yes", "no"))
    assert params.guided_decoding is None
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def test_sampling_params_take_a_dict_and_round_trip_through_json_fields():
    params = SamplingParams.from_dict({"structured_outputs": {"regex": "[0-9]+"}, "max_tokens": 5})
    assert params.structured_outputs.regex == "[0-9]+"
    assert params.to_dict()["structured_outputs"] == {"regex": "[0-9]+"}
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert pickle.loads(pickle.dumps(params)) == params  # data-parallel workers get params pickled
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_beam_search_takes_a_grammar_and_still_refuses_sampling_settings():
    params = SamplingParams(use_beam_search=True, temperature=0.0, n=2, structured_outputs={"regex": "a"})
    assert params.structured_outputs.regex == "a" and SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingParams(use_beam_search=True, temperature=1.0, n=2, structured_outputs={"regex": "a"})
