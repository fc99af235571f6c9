"""LLM: the one-call API. `LLM(...).generate(prompts, params)` adds every prompt and steps the engine
until all are done; results come back in input order."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from offline_paged.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.outputs import EngineStats, RequestError, RequestOutput
from offline_paged.sampling_params import SamplingParams

Prompt = str | list[int] | Mapping[str, Any]


class LLM:
    """Offline generation with vLLM's names: `LLM(model=None, device="auto", ...)`.

    Keyword arguments are EngineConfig fields (block_size, kv_cache_memory, num_kv_blocks,
    max_num_seqs, max_num_batched_tokens, max_model_len, seed, enable_prefix_caching,
    preemption_mode, swap_space, num_cpu_blocks, gpu_memory_utilization, ...).
    `loaded_model` skips loading (an already-loaded model, e.g. a tiny random one).
    `data_parallel_size=N` runs N engine processes (one per GPU; processes on the CPU too), each
    loading the model itself; a prompt a worker refuses raises ValueError from `generate` once the
    others are done. `close()` (or leaving a `with LLM(...)` block) stops them.
    """

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str | None = None,
                 *, loaded_model=None, data_parallel_size: int = 1, **engine_kwargs: Any) -> None:
        config = EngineConfig(model=model, device=device, dtype=dtype, **engine_kwargs)
        if data_parallel_size == 1:
            self.engine = LLMEngine(config, loaded_model=loaded_model)
        else:
            self.engine = _coordinator(config, loaded_model, data_parallel_size)
        self._next_id = 0

    def close(self) -> None:
        """Stop the data-parallel worker processes (nothing to do for one in-process engine)."""
        if hasattr(self.engine, "close"):
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list: text, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts. One SamplingParams for all, or one per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        request_ids: list[str] = []
        try:
            for prompt, param in zip(prompts, params):
                request_ids.append(self._add(prompt, param))
        except ValueError as exc:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise ValueError(f"prompt {len(request_ids)}: {exc}") from None
        return self._run(request_ids)

    def chat(
        self,
        conversations: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role", "content"}, ...]) or a list of them,
        rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        tokenizer = self.engine.tokenizer
        prompts = []
        for messages in conversations:
            text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt_token_ids": _encode_chat(tokenizer, text), "prompt": text})
        return self.generate(prompts, sampling_params)

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        request_id = f"llm-{self._next_id}"
        self._next_id += 1
        if isinstance(prompt, str):
            self.engine.add_request(request_id, prompt=prompt, params=params)
        elif isinstance(prompt, Mapping):
            self._add_mapping(request_id, prompt, params)
        else:
            self.engine.add_request(request_id, prompt_token_ids=list(prompt), params=params)
        return request_id

    def _add_mapping(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams) -> None:
        if "prompt_token_ids" in prompt:
            self.engine.add_request(request_id, prompt=prompt.get("prompt"),
                                    prompt_token_ids=list(prompt["prompt_token_ids"]), params=params)
        elif "prompt" in prompt:
            self.engine.add_request(request_id, prompt=prompt["prompt"], params=params)
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(wanted):
                for output in self.engine.step():
                    if output.request_id in wanted:
                        done[output.request_id] = output
        except BaseException:
            for request_id in wanted - done.keys():
                self.engine.abort_request(request_id)
            raise
        refused = [i for i, r in enumerate(request_ids) if isinstance(done[r], RequestError)]
        if refused:
            raise ValueError(f"prompt {refused[0]}: {done[request_ids[refused[0]]].message}")
        return [done[request_id] for request_id in request_ids]


def _coordinator(config: EngineConfig, loaded_model, data_parallel_size: int):
    from offline_paged.dp_coordinator import DataParallelCoordinator
    from offline_paged.dp_worker import WorkerSpec

    if loaded_model is not None:
        raise ValueError("loaded_model cannot be combined with data_parallel_size > 1: every worker "
                         "process loads the model itself; pass model= a path instead")
    return DataParallelCoordinator(WorkerSpec(config), data_parallel_size)


def _encode_chat(tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=False)  # the template wrote the specials
    except TypeError:
        return tokenizer.encode(text)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single token-id list
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
