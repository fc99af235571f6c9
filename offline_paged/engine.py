"""LLMEngine: add requests, then step() until done. One step = schedule -> execute -> postprocess.

SKELETON: the public signatures are fixed here so the job/CLI layer can code against them; the
bodies land in the following commits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from offline_paged.config import EngineConfig
from offline_paged.outputs import EngineStats, RequestOutput

if TYPE_CHECKING:
    from offline_paged.models.loader import LoadedModel
    from offline_paged.sampling_params import SamplingParams


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    `LLMEngine(config, loaded_model=None)`: loads `config.model` unless an already-loaded model
    (tests build tiny random ones) is given.
    """

    def __init__(self, config: EngineConfig, loaded_model: LoadedModel | None = None) -> None:
        raise NotImplementedError("engine body lands in the next commits")

    @property
    def tokenizer(self):
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue one request. Raises ValueError for a duplicate id, an empty prompt, a prompt
        longer than max_model_len, or parameters the engine cannot honour."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished in it."""
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request; True if it was known and unfinished."""
        raise NotImplementedError

    @property
    def stats(self) -> EngineStats:
        raise NotImplementedError
