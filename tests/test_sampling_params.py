"""SamplingParams: vLLM defaults, normalisation, and ValueError naming the field."""
import pytest

from offline_paged.core.sampling_params import FIELD_NAMES, SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_k, p.top_p, p.min_p) == (1, None, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (None, 16, 0, (), ())
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs) == (False, None, None)
    assert (p.use_beam_search, p.skip_special_tokens) == (False, True)


def test_stop_string_and_list_become_tuples():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == (2, 3)


def test_top_k_minus_one_means_off_and_is_stored_as_zero():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_integer_temperature_from_json_becomes_float():
    p = SamplingParams(temperature=0)
    assert isinstance(p.temperature, float) and p.greedy


def test_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().n = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0), ("n", 1.5), ("n", True), ("best_of", 0), ("temperature", -0.1),
        ("temperature", "hot"), ("temperature", float("nan")), ("top_k", -2),
        ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
        ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
        ("seed", -1), ("seed", 2**64), ("seed", "7"), ("max_tokens", -1), ("min_tokens", -1),
        ("stop", 5), ("stop", [""]), ("stop", ["a", 1]), ("stop_token_ids", [-1]),
        ("stop_token_ids", "2"), ("ignore_eos", 1), ("logprobs", -1), ("prompt_logprobs", -1),
        ("use_beam_search", "yes"), ("skip_special_tokens", None),
    ],
)
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_cross_field_rules_name_the_fields():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_beam_search_requires_deterministic_settings():
    p = SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0.0)
    assert p.beam_width == 4 and p.num_samples == 4
    assert SamplingParams(use_beam_search=True, n=3, temperature=0).beam_width == 3
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(use_beam_search=True, n=2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(use_beam_search=True, temperature=0, top_p=0.5)


def test_from_dict_accepts_known_fields():
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0, "stop": ["x"], "n": 2})
    assert (p.max_tokens, p.temperature, p.stop, p.n) == (5, 0.0, ("x",), 2)


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="unknown sampling field.*max_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": 5})
    with pytest.raises(ValueError, match="object"):
        SamplingParams.from_dict(["max_tokens"])  # type: ignore[arg-type]


def test_to_dict_round_trips():
    p = SamplingParams(n=2, stop=["a"], stop_token_ids=[4], seed=3, logprobs=2)
    d = p.to_dict()
    assert set(d) == set(FIELD_NAMES) and d["stop"] == ["a"]
    assert SamplingParams.from_dict(d) == p


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_an_integer_too_large_for_a_float_is_a_value_error(name):
    with pytest.raises(ValueError, match=f"{name} is too large"):
        SamplingParams(**{name: 10**400})


@pytest.mark.parametrize("name", ["n", "best_of"])
def test_n_and_best_of_are_capped_before_anything_is_sized_by_them(name):
    with pytest.raises(ValueError, match=f"{name} must be <= 1024"):
        SamplingParams(**{name: 10**12})
    assert SamplingParams(n=1024, best_of=1024).num_samples == 1024


def test_error_messages_cut_huge_values_short():
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=[[1] * 100_000])
    assert len(str(info.value)) < 200
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=10**4300)
