"""Test helper: a fake engine with the LLMEngine surface the job drives, fast and predictable.

A request "generates" its prompt bytes reversed (shifted by the sample index), truncated at
max_tokens, and finishes 1-3 steps after it was added (by prompt length), so finishing order
differs from input order. Prompts longer than `max_model_len` tokens are refused like the engine.
"""
from dataclasses import dataclass

from offline_paged.core.outputs import CompletionOutput, RequestOutput


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@dataclass
class FakeStats:
    num_steps: int = 0

    def to_dict(self) -> dict:
        return {"num_steps": self.num_steps, "kv_block_usage_current": 0.5}


class FakeEngine:
    def __init__(self, max_model_len: int = 40) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.num_steps = 0
        self.max_in_flight = 0
        self.added: list[str] = []
        self._requests: dict[str, tuple[str | None, list[int], object, int]] = {}

    def add_request(self, request_id, prompt=None, prompt_token_ids=None, params=None) -> None:
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.use_beam_search and params.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty cannot be combined with beam search")
        self._requests[request_id] = (prompt, ids, params, self.num_steps + 1 + len(ids) % 3)
        self.added.append(request_id)
        self.max_in_flight = max(self.max_in_flight, len(self._requests))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        done = [rid for rid, (*_, due) in self._requests.items() if due <= self.num_steps]
        return [self._output(rid, *self._requests.pop(rid)[:3]) for rid in done]

    @property
    def stats(self) -> FakeStats:
        return FakeStats(self.num_steps)

    def _output(self, request_id, prompt, ids, params) -> RequestOutput:
        outputs = [self._completion(i, ids, params) for i in range(params.n)]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [{t: -1.0} for t in ids[1:]]
        return RequestOutput(request_id, prompt, ids, prompt_logprobs, outputs, True, 0)

    def _completion(self, index, ids, params) -> CompletionOutput:
        tokens = [(t + index) % 128 for t in reversed(ids)][: params.max_tokens]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{t: -0.5, (t + 1) % 128: -1.5} for t in tokens]
        by_length = len(tokens) == params.max_tokens
        return CompletionOutput(index, self.tokenizer.decode(tokens), tokens, -0.5 * len(tokens),
                                logprobs, "length" if by_length else "stop", None, not by_length)
