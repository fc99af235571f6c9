"""offline-paged: offline batch LLM inference on PagedAttention, with vLLM's Python names.

    from offline_paged import LLM, SamplingParams
"""
from offline_paged.beam_search_params import BeamSearchParams
from offline_paged.inputs import TextPrompt, TokensPrompt
from offline_paged.llm import LLM
from offline_paged.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob,
                                   RequestOutput)
from offline_paged.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "TokensPrompt", "TextPrompt", "BeamSearchOutput", "BeamSearchSequence"]
