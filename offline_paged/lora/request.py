"""vLLM's `vllm.lora.request.LoRARequest`, so scripts that build one import cleanly.

LoRA adapters are not supported: building a LoRARequest works (a script may make one before it
decides to use it), and passing it to `LLM.generate` / `chat` / `beam_search` raises ValueError
"lora_request is not supported". Its fields are vLLM's, checked as vLLM checks them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter by name, integer id (>= 1) and path, as vLLM spells it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
