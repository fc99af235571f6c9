"""What `LLM.embed` and `LLM.encode` hand back, with vLLM's names and shapes.

`LLM.embed(...)[i].outputs.embedding` is a list of floats (vLLM's EmbeddingOutput);
`LLM.encode(...)[i].outputs.data` is the same vector as a float32 NumPy array [hidden_size]
(vLLM gives a torch tensor there).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """vLLM's per-request pooling settings: `normalize` None keeps the model's pooling configuration;
    `dimensions` (Matryoshka truncation) is not supported and must stay None."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {self.normalize!r}")
        if self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions is not supported (embeddings keep the model's hidden size)")


@dataclass(frozen=True, slots=True)
class PoolingOutput:
    data: np.ndarray  # [hidden_size] float32


@dataclass(frozen=True, slots=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
