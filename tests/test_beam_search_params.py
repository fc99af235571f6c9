"""BeamSearchParams (core/beam_search_params.py): the engine request it becomes, and refusals naming
vLLM's field names."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.core.beam_search_params import BeamSearchParams


def test_becomes_a_greedy_beam_request_keeping_every_beam():
    rng = np.random.default_rng(11)
    for _ in range(5):
        width, max_tokens = int(rng.integers(1, 9)), int(rng.integers(1, 50))
        ignore_eos, include_stop = bool(rng.integers(2)), bool(rng.integers(2))
        sampling = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    include_stop_str_in_output=include_stop).to_sampling_params()
        assert sampling.use_beam_search and sampling.n == sampling.best_of == width
        assert sampling.temperature == 0.0 and sampling.logprobs == 0
        assert (sampling.max_tokens, sampling.ignore_eos) == (max_tokens, ignore_eos)
        assert sampling.include_stop_str_in_output == include_stop


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.7), "temperature=0.7 is not supported"),
    (dict(length_penalty=0.5), "length_penalty=0.5 is not supported"),
    (dict(beam_width=0), "beam_width must"),
    (dict(max_tokens=-1), "max_tokens"),
])
def test_refusals_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**(dict(beam_width=2, max_tokens=4) | kwargs))


def test_a_grammar_reaches_the_engine_request():
    params = BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs={"choice": ["a", "b"]})
    sampling = params.to_sampling_params()
    assert sampling.use_beam_search and sampling.structured_outputs.choice == ("a", "b")
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs={"choices": ["a"]})
