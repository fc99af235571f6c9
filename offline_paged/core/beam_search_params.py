"""BeamSearchParams: the settings of `LLM.beam_search`, with current vLLM's names.

Runs on the engine's beam search (offline_paged/core/beam_search.py): `beam_width` beams, all of them
returned best first, scored `cumulative_logprob / length` (length_penalty 1.0, vLLM's default).
Beam search here is deterministic: temperature must be 0 and length_penalty 1.0; other values are
refused as not supported. `structured_outputs` (ours, not in vLLM's BeamSearchParams) constrains every beam
by a grammar (a StructuredOutputsParams or a dict of its fields), as SamplingParams' does.
"""
from __future__ import annotations

from dataclasses import dataclass

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is accepted too

    def __post_init__(self) -> None:
        if self.temperature != 0.0:
            raise ValueError(f"beam search with temperature={self.temperature} is not supported "
                             "(beam search here is deterministic: temperature 0)")
        if self.length_penalty != 1.0:
            raise ValueError(f"length_penalty={self.length_penalty} is not supported (only 1.0)")
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        self.to_sampling_params()  # validates beam_width, max_tokens and the flags, naming the field

    def to_sampling_params(self) -> SamplingParams:
        """The engine request: keep beam_width beams and return all of them, with the chosen tokens'
        log-probabilities."""
        try:
            return SamplingParams(n=self.beam_width, best_of=self.beam_width, use_beam_search=True,
                                  temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                                  include_stop_str_in_output=self.include_stop_str_in_output, logprobs=0,
                                  structured_outputs=self.structured_outputs)
        except ValueError as exc:
            raise ValueError(str(exc).replace("n must", "beam_width must")) from None
