"""OfflinePagedLM: an lm-evaluation-harness backend over the engine, registered as "offline-paged" on import.

    import offline_paged.lm_eval  # registers the model type (its public path)
    lm_eval.simple_evaluate(model="offline-paged", model_args="pretrained=DIR,dtype=float32", tasks=[...])

model_args follow lm-eval's vllm backend: pretrained (an HF directory, a hub id ORG/NAME from the HF cache,
a .gguf file, or nothing for the default model), dtype, max_model_len (or max_length), device, seed,
max_gen_toks, add_bos_token, prefix_token_id; batch_size / max_batch_size are accepted (every task runs as one generate call, the
engine batches it); other engine arguments (num_kv_blocks, kv_cache_memory, block_size, ...) pass to LLM.

Scoring: each (context, continuation) pair is one request with max_tokens=0, prompt_logprobs=1 and
prompt_logprobs_start at the continuation, so the context is never scored and, with prefix caching,
a context shared by the choices of a multiple-choice item is computed once. Tokenization follows
lm-eval's hf backend (so the same model directory gives the same token ids).
"""
from __future__ import annotations

import sys
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (_add_special_kwargs, handle_stop_sequences, has_bos_prefix, maybe_truncate,
                                  normalize_gen_kwargs, postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from offline_paged.entrypoints.llm import LLM
from offline_paged.entrypoints.scoring import generate_texts, generation_params, score_continuations

# lm-eval passes these to every backend; here every task is one generate call.
_BATCHING_ARGS = ("batch_size", "max_batch_size")


@register_model("offline-paged")
class OfflinePagedLM(TemplateLM):
    """lm-eval's LM interface: loglikelihood, loglikelihood_rolling, generate_until."""

    def __init__(self, pretrained: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                 max_length: int | None = None, device: str | None = "auto", seed: int = 1234,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 truncation_side: str = "left", **kwargs: Any) -> None:
        super().__init__()
        if max_length is not None and max_model_len is not None:
            raise ValueError("give max_model_len or max_length, not both")
        for name in _BATCHING_ARGS:
            kwargs.pop(name, None)
        length = max_model_len if max_model_len is not None else max_length
        self.llm = LLM(model=pretrained, device=_device(device), dtype=dtype, seed=int(seed),
                       max_model_len=None if length is None else int(length), **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        self.truncation_side = truncation_side
        self.pretrained = pretrained or "default"

    # ----------------------------------------------------------------- properties lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Longest model input, as the hf backend counts it: a scored sequence of max_length + 1 tokens
        (the last one is only predicted) is one engine prompt of max_model_len tokens."""
        return self.llm.llm_engine.max_model_len - 1

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's hf backend: the tokenizer's own special tokens unless told, none if the text
        already starts with the prefix token."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ----------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether greedy decoding would produce it) per
        (cache key, context ids, continuation ids); all requests in one generate call."""
        scored = []  # (token ids, where the continuation starts)
        for _, context, continuation in requests:
            tokens = (context + continuation)[-(self.max_length + 1):]  # the hf backend's left truncation
            if len(tokens) <= len(continuation):
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length "
                                 f"{self.max_length} with at least one context token")
            scored.append((tokens, len(tokens) - len(continuation)))
        results = self._score(scored, disable_tqdm)
        for (cache_key, _, _), result in zip(requests, results):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def _score(self, requests: list[tuple[list[int], int]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """The engine's part of the scoring requests (scoring.score_continuations); fp8_accuracy.py records it
        on one machine and replays it from another's answers."""
        return score_continuations(self.llm, requests, use_tqdm=not disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood over disjoint windows of max_length tokens (lm-eval's rule, the
        hf backend's window size); every window of every request in one generate call."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ----------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, specs = [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("do_sample", None)
            tokens, max_gen_toks = maybe_truncate(self.tok_encode(context), max_gen_toks=max_gen_toks,
                                                  max_model_len=self.max_length, side=self.truncation_side)
            generation_params(max_gen_toks, until, kwargs)  # refuses unsupported gen_kwargs before any work
            prompts.append(tokens)
            specs.append((max_gen_toks, until, kwargs))
        texts = []
        for req, raw, (_, until, _) in zip(requests, self._generate(prompts, specs, disable_tqdm), specs):
            text = postprocess_generated_text(raw, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    def _generate(self, prompts: list[list[int]], specs: list[tuple[int, list[str], dict]],
                  disable_tqdm: bool) -> list[str]:
        """The engine's part of generate_until (scoring.generate_texts), recorded and replayed like _score."""
        return generate_texts(self.llm, prompts, specs, use_tqdm=not disable_tqdm)


def _device(device: str | None) -> str:
    """lm-eval's device strings ("cuda:0", "cpu", None) -> ours ("cuda", "cpu", "auto"). lm-eval hands
    every backend "cuda" by default, so "cuda" on a machine without a usable CUDA device picks the way
    the engine's "auto" does (the CPU) instead of failing, and says so on stderr."""
    if device is None:
        return "auto"
    name = str(device).split(":")[0]
    if name == "cuda":
        from offline_paged.worker.backend import cuda_available

        if not cuda_available():
            print("offline-paged: lm-eval asked for device=cuda but no CUDA device is usable; "
                  "running on the CPU (device=auto)", file=sys.stderr)
            return "auto"
    return name
