"""vLLM's `LLM(...)` arguments -> EngineConfig fields.

Accepted as vLLM spells them: dtype="auto" / "half" / "float", enforce_eager (-> no CUDA graphs),
kv_cache_memory_bytes (-> kv_cache_memory), seed=None (-> 0), generation_config, and the harmless
ones at the values that change nothing here (tensor_parallel_size=1, trust_remote_code=False,
quantization=None, ...). Every other argument that is not an EngineConfig field is refused by name.
Note: `swap_space` keeps EngineConfig's meaning (bytes), not vLLM's GiB.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from offline_paged.core.config import EngineConfig
from offline_paged.entrypoints.generation_config import CHOICES as GENERATION_CONFIG_CHOICES

_DTYPE_ALIASES = {"auto": None, "half": "float16", "float": "float32", "bfloat16": "bfloat16"}
# vLLM arguments that change nothing here at these values (anything else is refused).
_NEUTRAL = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
            "trust_remote_code": False, "quantization": None, "revision": None, "tokenizer_revision": None,
            "tokenizer_mode": "auto", "cpu_offload_gb": 0, "skip_tokenizer_init": False,
            "enable_lora": False, "hf_token": None, "hf_overrides": None}
# vLLM arguments that only tune vLLM's own machinery; any value is accepted and ignored.
_IGNORED = ("disable_log_stats", "disable_custom_all_reduce", "max_seq_len_to_capture", "enable_chunked_prefill",
            "distributed_executor_backend")
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))


def engine_kwargs(model: str | None, dtype: str | None, kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(EngineConfig keyword arguments, generation_config choice). Raises ValueError naming an
    argument that is not supported."""
    kwargs = dict(kwargs)
    config: dict[str, Any] = {"model": model, "dtype": _DTYPE_ALIASES.get(dtype, dtype)}
    generation_config = kwargs.pop("generation_config", "auto")
    if not isinstance(generation_config, str):
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES} or a directory")
    if "enforce_eager" in kwargs:
        config["cuda_graphs"] = not kwargs.pop("enforce_eager")
    if "kv_cache_memory_bytes" in kwargs:
        config["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
    if "seed" in kwargs and kwargs["seed"] is None:
        kwargs["seed"] = 0
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != model:
        raise ValueError(f"tokenizer={tokenizer!r} is not supported (the model's own tokenizer is used)")
    for name in _IGNORED:
        kwargs.pop(name, None)
    for name, neutral in _NEUTRAL.items():
        if name in kwargs and kwargs.pop(name) != neutral:
            raise ValueError(f"{name} is not supported (only {name}={neutral!r})")
    unsupported = sorted(set(kwargs) - _ENGINE_FIELDS)
    if unsupported:
        raise ValueError(f"LLM argument(s) {', '.join(unsupported)} not supported by offline-paged "
                         f"(supported: {', '.join(sorted(_ENGINE_FIELDS - {'model', 'dtype'}))}, "
                         "enforce_eager, kv_cache_memory_bytes, generation_config)")
    return config | kwargs, generation_config
