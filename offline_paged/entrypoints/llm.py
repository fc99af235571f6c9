"""LLM: the one-call API with vLLM's surface. `LLM(...).generate(prompts, params)` adds every prompt and
steps the engine until all are done; results come back in input order.

Where the engine hands out plain {token_id: float} log-probabilities, LLM hands out vLLM's
{token_id: Logprob(logprob, rank, decoded_token)} (decoded_token None with detokenize=False).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from offline_paged.core import gc_pacing
from offline_paged.core.beam_search_params import BeamSearchParams
from offline_paged.core.config import EngineConfig
from offline_paged.core.outputs import (BeamSearchOutput, BeamSearchSequence, EngineStats, RequestError,
                                        RequestOutput, to_logprob_dicts)
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine
from offline_paged.entrypoints.generation_config import sampling_defaults
from offline_paged.entrypoints.hf_tokenizer import HFTokenizer, render_chat
from offline_paged.entrypoints.inputs import prompt_fields
from offline_paged.entrypoints.llm_args import engine_kwargs
from offline_paged.entrypoints.pooling_outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                                       PoolingParams, PoolingRequestOutput)
from offline_paged.entrypoints.progress import RequestProgress
from offline_paged.models.hub import resolve_model
from offline_paged.models.pooling import PoolingConfig
from offline_paged.models.tokenizer import batch_ids, encode_all

Prompt = str | list[int] | Mapping[str, Any]


class LLM:
    """Offline generation with vLLM's names: `LLM(model=None, device="auto", dtype="auto", ...)`.

    Keyword arguments are EngineConfig fields (block_size, kv_cache_memory, num_kv_blocks,
    max_num_seqs, max_num_batched_tokens, max_model_len, seed, enable_prefix_caching,
    preemption_mode, swap_space, num_cpu_blocks, gpu_memory_utilization, ...) plus the vLLM
    spellings llm_args.py translates; anything else raises ValueError naming it.
    `loaded_model` skips loading (an already-loaded model, e.g. a tiny random one).
    `data_parallel_size=N` runs N engine processes (one per GPU; processes on the CPU too), each
    loading the model itself; a prompt a worker refuses raises ValueError from `generate` once the
    others are done. `close()` (or leaving a `with LLM(...)` block) stops them.
    `tensor_parallel_size=N` shards the model over N processes (one GPU each; rank 0 is this process's
    engine); N must divide the attention heads, KV heads and intermediate size.
    """

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str | None = "auto",
                 *, loaded_model=None, data_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 **kwargs: Any) -> None:
        args = engine_kwargs(model, dtype, kwargs)
        if loaded_model is None and model is not None:  # a hub id -> its local snapshot (models/hub.py)
            args.config["model"] = str(resolve_model(model, args.revision))
        config = EngineConfig(device=device, tensor_parallel_size=tensor_parallel_size, **args.config)
        if tensor_parallel_size != 1 and data_parallel_size != 1:
            raise ValueError("tensor_parallel_size and data_parallel_size cannot be combined yet")
        if data_parallel_size == 1:
            self.engine = LLMEngine(config, loaded_model=loaded_model)
        else:
            self.engine = _coordinator(config, loaded_model, data_parallel_size)
        source = getattr(loaded_model, "source", None) if loaded_model is not None else self._source(config.model)
        self.model_name = args.served_model_name or model or "SmolLM2-135M-Instruct"
        self._default_sampling = sampling_defaults(source, args.generation_config)
        self._pooling = PoolingConfig.from_dir(source).with_overrides(args.pooler_config)
        self._tokenizer = HFTokenizer(self.engine.tokenizer)
        self._next_id = 0

    def close(self) -> None:
        """Stop the data-parallel worker or tensor-parallel rank processes (nothing to do otherwise)."""
        if hasattr(self.engine, "close"):
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _source(model: str | None) -> str | None:
        if model is None or model == "default":
            from offline_paged.models.default_model import default_model_dir

            return str(default_model_dir())
        return None if str(model).endswith(".gguf") else str(model)

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine

    def get_tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's rule)."""
        return SamplingParams(**self._default_sampling)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None, priority=None) -> list[RequestOutput]:
        """Generate for one prompt or a list: text, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts (TextPrompt / TokensPrompt). One SamplingParams for all, or
        one per prompt; None uses get_default_sampling_params()."""
        _refuse(lora_request=lora_request, priority=priority)
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        prompts = self._with_token_ids(prompts)
        request_ids: list[str] = []
        try:
            for prompt, param in zip(prompts, params):
                request_ids.append(self._add(prompt, param))
        except ValueError as exc:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise ValueError(f"prompt {len(request_ids)}: {exc}") from None
        outputs = self._run(request_ids, RequestProgress(len(request_ids), use_tqdm))
        return [self._vllm_output(out, param) for out, param in zip(outputs, params)]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools=None,
             chat_template_kwargs: Mapping[str, Any] | None = None, mm_processor_kwargs=None) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role", "content"}, ...]) or a list of them, rendered
        with the model's chat template (or `chat_template`); `chat_template_kwargs` reach the template."""
        _refuse(lora_request=lora_request, tools=tools, mm_processor_kwargs=mm_processor_kwargs)
        if continue_final_message:
            raise ValueError("continue_final_message is not supported")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not supported")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tokenizer = self.engine.tokenizer
        texts = [render_chat(tokenizer, [_text_message(m) for m in conversation], add_generation_prompt,
                             chat_template, chat_template_kwargs or {}) for conversation in conversations]
        token_ids = encode_all(tokenizer, texts, add_special_tokens=False)  # the template wrote its specials
        prompts = [{"prompt_token_ids": ids, "prompt": text} for text, ids in zip(texts, token_ids)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool | Callable = True, lora_request=None, truncate_prompt_tokens: int | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: one embedding per prompt (text, token ids or prompt dicts), pooled as the
        model's sentence-transformers config says (else last token, normalised); `pooler_config=` at
        construction or `PoolingParams(normalize=...)` here override it."""
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                                       out.prompt_token_ids)
                for out in self.encode(prompts, pooling_params, use_tqdm, lora_request, "embed",
                                       truncate_prompt_tokens)]

    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
               use_tqdm: bool | Callable = True, lora_request=None, pooling_task: str = "embed",
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode for pooling_task "embed": `outputs.data` is a float32 array [hidden_size]."""
        _refuse(lora_request=lora_request)
        if pooling_task != "embed":
            raise ValueError(f"pooling_task={pooling_task!r} is not supported (only \"embed\")")
        if not hasattr(self.engine, "embed"):
            raise ValueError("embeddings are not supported with data_parallel_size > 1")
        pooling = self._pooling
        if pooling_params is not None and pooling_params.normalize is not None:
            pooling = dataclasses.replace(pooling, normalize=pooling_params.normalize)
        token_ids = [self._token_ids(p, truncate_prompt_tokens) for p in _as_prompt_list(prompts)]
        vectors = self.engine.embed(token_ids, pooling)
        first = self._next_id
        self._next_id += len(token_ids)
        return [PoolingRequestOutput(f"embd-{first + i}", PoolingOutput(vector), ids)
                for i, (ids, vector) in enumerate(zip(token_ids, vectors))]

    def _token_ids(self, prompt: Prompt, truncate: int | None) -> list[int]:
        if isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping):
            text, ids = prompt_fields(prompt)
            ids = self.engine.tokenizer.encode(text) if ids is None else ids
        else:
            ids = list(prompt)
        if truncate == -1:  # vLLM: as many as max_model_len allows
            truncate = self.engine.max_model_len
        return ids[-truncate:] if truncate else ids

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool | Callable = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: beam_width hypotheses per prompt, best first."""
        _refuse(lora_request=lora_request)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(list(prompts), params.to_sampling_params(), use_tqdm=use_tqdm)
        eos = set(self.engine.eos_token_ids)
        return [BeamSearchOutput([self._beam_sequence(out, c, eos, params.ignore_eos) for c in out.outputs])
                for out in outputs]

    def _beam_sequence(self, out: RequestOutput, completion, eos: set[int], ignore_eos: bool) -> BeamSearchSequence:
        ids = list(completion.token_ids)
        shown = ids[:-1] if ids and ids[-1] in eos and not ignore_eos else ids
        return BeamSearchSequence(tokens=list(out.prompt_token_ids) + ids, logprobs=completion.logprobs,
                                  cum_logprob=completion.cumulative_logprob,
                                  text=self._tokenizer.decode(shown, skip_special_tokens=False),
                                  finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    # ----------------------------------------------------------------- internals
    def _with_token_ids(self, prompts: list[Prompt]) -> list[Prompt]:
        """Text prompts with their ids, tokenised in one batch (the tokenizer's threads, without the GIL) instead
        of one by one as they are added; the others as they are. A text the tokenizer fails on leaves every text
        to add_request, whose error names its prompt."""
        batch = batch_ids(self.engine.tokenizer, [prompt for prompt in prompts if isinstance(prompt, str)], True)
        if batch is None:
            return prompts
        token_ids = iter(batch)
        return [{"prompt": prompt, "prompt_token_ids": next(token_ids)} if isinstance(prompt, str) else prompt
                for prompt in prompts]

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        request_id = f"llm-{self._next_id}"
        self._next_id += 1
        if isinstance(prompt, str):
            self.engine.add_request(request_id, prompt=prompt, params=params)
        elif isinstance(prompt, Mapping):
            text, token_ids = prompt_fields(prompt)
            self.engine.add_request(request_id, prompt=text, prompt_token_ids=token_ids, params=params)
        else:
            self.engine.add_request(request_id, prompt_token_ids=list(prompt), params=params)
        return request_id

    def _run(self, request_ids: list[str], progress: RequestProgress) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        try:
            with gc_pacing.paced():
                while len(done) < len(wanted):
                    for output in self.engine.step():
                        if output.request_id in wanted:
                            done[output.request_id] = output
                            if not isinstance(output, RequestError):  # a worker refused it
                                progress.update(output)
        except BaseException:
            for request_id in wanted - done.keys():
                self.engine.abort_request(request_id)
            raise
        finally:
            progress.close()
        refused = [i for i, r in enumerate(request_ids) if isinstance(done[r], RequestError)]
        if refused:
            raise ValueError(f"prompt {refused[0]}: {done[request_ids[refused[0]]].message}")
        return [done[request_id] for request_id in request_ids]

    def _vllm_output(self, out: RequestOutput, params: SamplingParams) -> RequestOutput:
        """The engine's float log-probabilities as Logprob objects (ranked within the asked top-k)."""
        decode = self._decoder() if params.detokenize else None
        completions = [dataclasses.replace(c, logprobs=to_logprob_dicts(c.logprobs, params.logprobs or 0, decode))
                       for c in out.outputs]
        prompt_logprobs = to_logprob_dicts(out.prompt_logprobs, params.prompt_logprobs or 0, decode)
        return dataclasses.replace(out, outputs=completions, prompt_logprobs=prompt_logprobs)

    def _decoder(self) -> Callable[[int], str]:
        decode = self.engine.tokenizer.decode
        cache: dict[int, str] = {}

        def decode_token(token_id: int) -> str:
            if token_id not in cache:
                cache[token_id] = decode([token_id], skip_special_tokens=False)
            return cache[token_id]
        return decode_token


def _coordinator(config: EngineConfig, loaded_model, data_parallel_size: int):
    from offline_paged.dp.dp_coordinator import DataParallelCoordinator
    from offline_paged.dp.dp_worker import WorkerSpec

    if loaded_model is not None:
        raise ValueError("loaded_model cannot be combined with data_parallel_size > 1: every worker "
                         "process loads the model itself; pass model= a path instead")
    return DataParallelCoordinator(WorkerSpec(config), data_parallel_size)


def _refuse(**arguments: Any) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(f"{name} is not supported")


def _text_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message whose OpenAI content parts ([{"type": "text", "text": ...}, ...]) are joined
    into one string, as the JSONL path does; any other part type is refused by name."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        kinds = sorted({str(p.get("type")) if isinstance(p, Mapping) else type(p).__name__ for p in content} - {"text"})
        if kinds:
            raise ValueError(f"content part type(s) {', '.join(kinds)} not supported (only text parts)")
        message["content"] = "".join(str(p.get("text", "")) for p in content)
    return message


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single token-id list
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be SamplingParams objects")
    return params
