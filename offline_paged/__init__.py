"""offline-paged: offline batch LLM inference on PagedAttention, with vLLM's Python names.

    from offline_paged import LLM, SamplingParams
"""
from offline_paged.core.beam_search_params import BeamSearchParams
from offline_paged.core.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob,
                                        RequestOutput)
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.structured_outputs import GuidedDecodingParams, StructuredOutputsParams
from offline_paged.entrypoints.inputs import TextPrompt, TokensPrompt
from offline_paged.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "TokensPrompt", "TextPrompt", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams",
           "GuidedDecodingParams"]
