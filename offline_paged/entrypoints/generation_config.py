"""Sampling defaults from a model's generation_config.json, applied as vLLM applies them.

vLLM (generation_config="auto", its default) reads repetition_penalty, temperature, top_k, top_p,
min_p and max_new_tokens (as max_tokens) from the model's generation_config.json, and `LLM.generate`
uses them when it is called without sampling params (`LLM.get_default_sampling_params()`).
generation_config="vllm" ignores the file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
         "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
CHOICES = ("auto", "vllm")


def sampling_defaults(model_source: str | None, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams overrides from `<model dir>/generation_config.json` (empty for GGUF files,
    a missing file, or generation_config="vllm"). A directory path instead of "auto" reads that one."""
    if generation_config == "vllm" or model_source is None:
        return {}
    directory = Path(model_source if generation_config == "auto" else generation_config)
    path = directory / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config: {path} not found (give 'auto', 'vllm' or a directory)")
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return {ours: raw[theirs] for theirs, ours in _KEYS.items() if raw.get(theirs) is not None}
