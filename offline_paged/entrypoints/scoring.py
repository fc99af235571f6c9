"""The engine's side of lm-eval's requests, without lm-eval: scoring continuations and raw generation.

The lm-eval backend (entrypoints/lm_eval.py) does lm-eval's request handling (tokenization, truncation, stop
sequences, post-processing) and hands the engine work to these functions. benchmarks/fp8_accuracy.py calls them
directly on a machine that has the engine but not lm-eval (the GPU machine): lm-eval records the requests on one
machine, the engine answers them on the other, and lm-eval scores the answers where it was recorded.
"""
from __future__ import annotations

from typing import Any

from offline_paged.core.sampling_params import FIELD_NAMES, SamplingParams
from offline_paged.entrypoints.inputs import TokensPrompt


def score_continuations(llm, requests: list[tuple[list[int], int]], use_tqdm: bool = False) -> list[tuple[float, bool]]:
    """Per (token ids, start): (sum of the logprobs of tokens[start:], whether greedy decoding would produce
    them), all in one generate call. Each is one request with max_tokens=0 and prompt_logprobs from `start`, so
    tokens before it are never scored, and with prefix caching a context shared by several requests is computed
    once."""
    params = [SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1, prompt_logprobs_start=start,
                             detokenize=False) for _, start in requests]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens, _ in requests], params,
                           use_tqdm=use_tqdm)
    results = []
    for (tokens, start), output in zip(requests, outputs):
        entries = output.prompt_logprobs[start:]
        total = sum(entry[token].logprob for token, entry in zip(tokens[start:], entries))
        greedy = all(next(iter(entry)) == token for token, entry in zip(tokens[start:], entries))
        results.append((total, greedy))
    return results


def generation_params(max_gen_toks: int, until: list[str], kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams for one generate_until request (lm-eval's gen_kwargs, already normalized, without
    until / max_gen_toks / do_sample); gen_kwargs we have no field for are refused by name."""
    unsupported = sorted(set(kwargs) - set(FIELD_NAMES))
    if unsupported:
        raise ValueError(f"gen_kwargs {', '.join(unsupported)} not supported by offline-paged")
    return SamplingParams(**kwargs, max_tokens=max_gen_toks, stop=[s for s in until if s])


def generate_texts(llm, prompts: list[list[int]], specs: list[tuple[int, list[str], dict]],
                   use_tqdm: bool = False) -> list[str]:
    """The generated text (before lm-eval's post-processing) of each prompt (token ids), with its spec
    (max_gen_toks, until, gen_kwargs) as generation_params takes it; all in one generate call."""
    params = [generation_params(*spec) for spec in specs]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens in prompts], params, use_tqdm=use_tqdm)
    return [output.outputs[0].text for output in outputs]
