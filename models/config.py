"""LlamaConfig: the hyper-parameters of a Llama-layout model, read from an HF `config.json`.

Both RoPE spellings are accepted: the old one (`rope_theta` + `rope_scaling`) and the new one
(`rope_parameters` with `rope_type`/`rope_theta`). RoPE scaling of type `llama3` and `linear` is
supported; anything else is refused with a message naming the file and the type.
The architecture (Llama, Mistral, Qwen2, Qwen3) picks an `ArchSpec` (models/arch_spec.py): its
biases, q/k norm, sliding window and the transformers defaults of keys config.json may leave out.
Mistral's `sliding_window` is computed (null: none; absent: MistralConfig's default, 4096).
A `quantization_config` of an FP8 checkpoint (vLLM's "fp8", compressed-tensors FP8) becomes
`LlamaConfig.quantization` (models/quant_config.py); any other is refused by name.
Everything the config asks for that this decoder does not compute (another `hidden_act`, another
quantization, biases the architecture does not have, Qwen2/Qwen3 per-layer sliding windows,
partial RoPE) is refused by name, and every value is type- and range-checked (positive sizes under
generous limits, finite positive eps and theta, token ids inside the vocabulary), so a bad config
fails at load, never as NaN logits later.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .arch_spec import ARCHITECTURE_OF_MODEL_TYPE, SUPPORTED_ARCHITECTURES, ArchSpec, arch_spec
from .quant_config import Fp8CheckpointConfig

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. `linear` divides every frequency by `factor`; `llama3` divides only the
    low frequencies and interpolates between `low_freq_factor` and `high_freq_factor`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r} (supported: llama3, linear)")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _require_positive_finite(f"rope scaling {name}", getattr(self, name))
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope scaling high_freq_factor ({self.high_freq_factor}) must be greater than "
                             f"low_freq_factor ({self.low_freq_factor})")
        if _not_int(self.original_max_position_embeddings) or self.original_max_position_embeddings <= 0:
            raise ValueError("rope scaling original_max_position_embeddings must be a positive integer, "
                             f"got {self.original_max_position_embeddings!r}")


# Upper bounds no real checkpoint comes near; they keep a hostile config from sizing anything absurd
# before the loader has compared it with the tensors actually present.
SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19,
               "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
               "head_dim": 2048, "max_position_embeddings": 1 << 40}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shapes and constants of a Llama-layout decoder: Llama, Mistral, Qwen2/Qwen2.5 and Qwen3
    (`spec` says what the architecture adds). `sliding_window` w (Mistral only): every layer's query
    at position p attends to keys p - w < k <= p; None: the whole causal context."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    quantization: Fp8CheckpointConfig | None = None  # a pre-quantized FP8 checkpoint's linears

    def __post_init__(self) -> None:
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name)
            if _not_int(value) or not 0 < value <= limit:
                raise ValueError(f"{name} must be an integer in 1..{limit}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _require_positive_finite("rms_norm_eps", self.rms_norm_eps)
        _require_positive_finite("rope_theta", self.rope_theta)
        for name, ids in (("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
                          ("eos_token_id", self.eos_token_ids)):
            bad = [i for i in ids if _not_int(i) or not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad[0]!r} is not a token id of the vocabulary "
                                 f"(vocab_size {self.vocab_size})")
        spec = arch_spec(self.architecture)
        if self.sliding_window is not None:
            if spec.window_switch != "sliding_window":
                raise ValueError(f"sliding_window is not computed for {self.architecture} (only Mistral's "
                                 f"every-layer window is), got {self.sliding_window!r}")
            if _not_int(self.sliding_window) or self.sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")

    @property
    def spec(self) -> ArchSpec:
        return arch_spec(self.architecture)

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """Read an HF config.json; every problem is a ValueError naming the file and the field."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: config.json not found") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"{path}: not valid JSON ({type(exc).__name__}: {exc})") from None
        try:
            return cls.from_dict(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build from an HF config dict; raises ValueError naming the offending key. Anything the
        config asks for that this decoder does not compute is refused, never ignored."""
        if not isinstance(raw, dict):
            raise ValueError(f"the config must be a JSON object, got {type(raw).__name__}")
        spec = arch_spec(_architecture(raw))
        _refuse_what_we_do_not_compute(raw)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"missing required keys: {', '.join(missing)}")
        _refuse_qwen_sliding_window(raw, spec)
        num_heads = _int(raw, "num_attention_heads")
        hidden = _int(raw, "hidden_size")
        default_head_dim = spec.default_head_dim or (hidden // num_heads if num_heads > 0 else 0)
        rope_theta, rope_scaling = _rope(raw)
        return cls(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_hidden_layers=_int(raw, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=_int(raw, "num_key_value_heads", num_heads),
            head_dim=_int(raw, "head_dim", default_head_dim),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),  # transformers' default for all four
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(raw, "max_position_embeddings", spec.default_max_position_embeddings),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", spec.default_tie_word_embeddings),
            architecture=spec.architecture,
            bos_token_id=_int(raw, "bos_token_id", None),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
            sliding_window=_mistral_window(raw, spec),
            quantization=None if raw.get("quantization_config") is None
            else Fp8CheckpointConfig.from_dict(raw["quantization_config"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """An HF-style config dict (old rope spelling, which every transformers version reads)."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.spec.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.spec.window_switch is not None:
            out |= {"sliding_window": self.sliding_window, "use_sliding_window": False}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                out["rope_scaling"].update(low_freq_factor=s.low_freq_factor,
                                           high_freq_factor=s.high_freq_factor,
                                           original_max_position_embeddings=s.original_max_position_embeddings)
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_dict()
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures must be a list of names, got {str(archs)[:60]!r}")
    if not archs:
        model_type = raw.get("model_type")
        archs = [ARCHITECTURE_OF_MODEL_TYPE[model_type]] if model_type in ARCHITECTURE_OF_MODEL_TYPE else []
        if not archs:
            raise ValueError(f"no 'architectures' and unknown model_type {model_type!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _refuse_what_we_do_not_compute(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (this decoder computes silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not supported")


def _mistral_window(raw: dict[str, Any], spec: ArchSpec) -> int | None:
    """Mistral's window on every layer: config.json's `sliding_window` (null: none), or transformers'
    class default when the key is absent. None for the other architectures."""
    if spec.window_switch != "sliding_window":
        return None
    window = raw.get("sliding_window", spec.default_sliding_window)
    if window is not None and (_not_int(window) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer or null, got {str(window)[:40]!r}")
    return window


def _refuse_qwen_sliding_window(raw: dict[str, Any], spec: ArchSpec) -> None:
    """Qwen2/Qwen3 windows apply to some layers only (max_window_layers, layer_types): not computed,
    so any layer with a window is refused by name."""
    if spec.window_switch == "use_sliding_window":
        sliding = _sliding_layers(raw, spec)
        if sliding:
            raise ValueError(f"sliding-window attention is not supported: {sliding}")


def _sliding_layers(raw: dict[str, Any], spec: ArchSpec) -> str:
    """Which layers transformers' Qwen2/Qwen3 give a window, and why ("" for none)."""
    num_layers = _int(raw, "num_hidden_layers")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(
                t not in kinds for t in layer_types):
            raise ValueError(f"layer_types must list {' or '.join(kinds)} for each of the "
                             f"{num_layers} layers, got {str(layer_types)[:60]!r}")
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        return f"layer_types marks layers {sliding} as sliding_attention" if sliding else ""
    window = raw.get("sliding_window", spec.default_sliding_window)
    if not _bool(raw, "use_sliding_window", False) or window is None:
        return ""
    first = _int(raw, "max_window_layers", 28)  # transformers' Qwen2Config / Qwen3Config default
    if first >= num_layers:
        return ""
    return (f"use_sliding_window is true, so layers {max(first, 0)}..{num_layers - 1} (max_window_layers "
            f"{first}) would attend within sliding_window {window}")


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Return (theta, scaling) from either the old or the new (`rope_parameters`) spelling."""
    params = raw.get("rope_parameters")
    key = "rope_parameters" if params is not None else "rope_scaling"
    scaling = params if params is not None else raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"{key} must be an object or null, got {str(scaling)[:40]!r}")
    theta = _float(scaling, "rope_theta", None) if scaling else None
    theta = theta if theta is not None else _float(raw, "rope_theta", 10000.0)
    partial = (scaling or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported (RoPE over the whole head only)")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {str(rope_type)[:40]!r} in {key} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    if "factor" not in scaling:
        raise ValueError(f"{key}: rope scaling {rope_type!r} needs a 'factor'")
    fields = {k: _float(scaling, k, None) for k in ("low_freq_factor", "high_freq_factor") if k in scaling}
    if "original_max_position_embeddings" in scaling:
        fields["original_max_position_embeddings"] = _int(scaling, "original_max_position_embeddings")
    if rope_type == "linear":
        fields = {}
    return theta, RopeScaling(rope_type=rope_type, factor=_float(scaling, "factor"), **fields)


_REQUIRED = object()


def _not_int(value) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def _int(raw: dict[str, Any], key: str, default: Any = _REQUIRED):
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{key} is required")
        return default
    if _not_int(value):
        raise ValueError(f"{key} must be an integer, got {str(value)[:40]!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: Any = _REQUIRED):
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{key} is required")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {str(value)[:40]!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{key} must be a finite number, got an integer of {len(str(value))} digits") from None


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {str(value)[:40]!r}")
    return value


def _require_positive_finite(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    bad = [v for v in values if _not_int(v)]
    if bad:
        raise ValueError(f"eos_token_id must be an integer or a list of integers, got {str(value)[:40]!r}")
    return tuple(values)
