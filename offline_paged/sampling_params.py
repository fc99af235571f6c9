"""vLLM's module path `vllm.sampling_params`: `from offline_paged.sampling_params import SamplingParams`.

Re-exports only; the classes live in offline_paged.core. `RequestOutputKind` exists for scripts that
name it: a batch engine hands out finished outputs only, so FINAL_ONLY is the one kind honoured.
`StructuredOutputsParams` / `GuidedDecodingParams` come from the structured-output module when this
build has it.
"""
from enum import Enum

from offline_paged.core.beam_search_params import BeamSearchParams
from offline_paged.core.sampling_params import SamplingParams

try:
    from offline_paged.core.structured_outputs import GuidedDecodingParams, StructuredOutputsParams  # noqa: F401
except ImportError:  # a build without structured output
    pass


class RequestOutputKind(Enum):
    """vLLM's output kinds; offline generation returns each request once, finished (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


__all__ = ["SamplingParams", "BeamSearchParams", "RequestOutputKind", "StructuredOutputsParams",
           "GuidedDecodingParams"]
__all__ = [name for name in __all__ if name in globals()]
