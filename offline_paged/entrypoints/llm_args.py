"""vLLM's `LLM(...)` arguments -> EngineConfig fields and the few settings LLM keeps itself.

Accepted as vLLM spells them: dtype="auto" / "half" / "float", enforce_eager (-> no CUDA graphs),
kv_cache_memory_bytes (-> kv_cache_memory), seed=None (-> 0), swap_space in GiB as in vLLM (-> bytes),
generation_config, revision (of a hub id), served_model_name, the pooling switches (runner="pooling",
task="embed", convert="embed": one model here generates and embeds, so they select nothing) and
pooler_config / override_pooler_config (pooling_type, normalize), and the harmless ones at the values
that change nothing here (pipeline_parallel_size=1, trust_remote_code: either value,
as every architecture we run is built in). Every other argument that is not an EngineConfig field is
refused by name. EngineConfig's field names are also the CLI's engine options (cli/engine_options.py),
so `--num-kv-blocks` and `LLM(num_kv_blocks=...)` are one setting (vLLM's kv_cache_dtype="fp8" /
calculate_kv_scales among them: the FP8 KV cache, and quantization="fp8"); data_parallel_size and
tensor_parallel_size are LLM's own parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from offline_paged.core.config import DTYPE_ALIASES, EngineConfig
from offline_paged.entrypoints.generation_config import CHOICES as GENERATION_CONFIG_CHOICES

GiB = 1 << 30
_DTYPE_ALIASES = {"auto": None, **DTYPE_ALIASES}  # the CLI's --dtype maps the same aliases
# vLLM arguments that change nothing here at these values (anything else is refused).
_NEUTRAL = {"pipeline_parallel_size": 1, "tokenizer_revision": None,
            "tokenizer_mode": "auto", "cpu_offload_gb": 0, "skip_tokenizer_init": False,
            "enable_lora": False, "hf_token": None, "hf_overrides": None}
# vLLM arguments that only tune vLLM's own machinery; any value is accepted and ignored.
_IGNORED = ("disable_log_stats", "disable_custom_all_reduce", "max_seq_len_to_capture", "enable_chunked_prefill",
            "distributed_executor_backend", "trust_remote_code")
# vLLM's model-runner choices: ours generates and pools with the same model, so these select nothing.
_RUNNER_CHOICES = {"runner": ("auto", "generate", "pooling"), "task": ("auto", "generate", "embed"),
                   "convert": ("auto", "none", "embed")}
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))


@dataclass(frozen=True, slots=True)
class LLMArgs:
    """`config`: EngineConfig keyword arguments; the rest is what LLM itself uses."""

    config: dict[str, Any]
    generation_config: str = "auto"
    revision: str | None = None
    pooler_config: Any = None  # a dict or object with pooling_type / normalize; None: the model's
    served_model_name: str | None = None


def engine_kwargs(model: str | None, dtype: str | None, kwargs: dict[str, Any]) -> LLMArgs:
    """Raises ValueError naming an argument that is not supported."""
    kwargs = dict(kwargs)
    config: dict[str, Any] = {"model": model, "dtype": _DTYPE_ALIASES.get(dtype, dtype)}
    generation_config = kwargs.pop("generation_config", "auto")
    if not isinstance(generation_config, str):
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES} or a directory")
    if "enforce_eager" in kwargs:
        config["cuda_graphs"] = not kwargs.pop("enforce_eager")
    if "kv_cache_memory_bytes" in kwargs:
        config["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
    if "swap_space" in kwargs:
        config["swap_space"] = _gib_to_bytes(kwargs.pop("swap_space"))
    if "seed" in kwargs and kwargs["seed"] is None:
        kwargs["seed"] = 0
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != model:
        raise ValueError(f"tokenizer={tokenizer!r} is not supported (the model's own tokenizer is used)")
    _check_runner_choices(kwargs)
    pooler_config = kwargs.pop("pooler_config", None) or kwargs.pop("override_pooler_config", None)
    kept = {name: kwargs.pop(name, None) for name in ("revision", "served_model_name")}
    if isinstance(kept["served_model_name"], (list, tuple)):
        kept["served_model_name"] = kept["served_model_name"][0] if kept["served_model_name"] else None
    for name in _IGNORED:
        kwargs.pop(name, None)
    for name, neutral in _NEUTRAL.items():
        if name in kwargs and kwargs.pop(name) != neutral:
            raise ValueError(f"{name} is not supported (only {name}={neutral!r})")
    unsupported = sorted(set(kwargs) - _ENGINE_FIELDS)
    if unsupported:
        raise ValueError(f"LLM argument(s) {', '.join(unsupported)} not supported by offline-paged "
                         f"(supported: {', '.join(sorted(_ENGINE_FIELDS - {'model', 'dtype'}))}, "
                         "enforce_eager, kv_cache_memory_bytes, generation_config, revision, pooler_config)")
    return LLMArgs(config | kwargs, generation_config, kept["revision"], pooler_config, kept["served_model_name"])


def _gib_to_bytes(value: Any) -> int:
    """vLLM's swap_space is GiB (a float may give a fraction)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"swap_space is in GiB (as in vLLM) and must be a number >= 0, got {value!r}")
    return int(value * GiB)


def _check_runner_choices(kwargs: dict[str, Any]) -> None:
    for name, choices in _RUNNER_CHOICES.items():
        value = kwargs.pop(name, "auto")
        if value not in choices:
            raise ValueError(f"{name}={value!r} is not supported (supported: {', '.join(choices)})")
