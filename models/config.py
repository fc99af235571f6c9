"""LlamaConfig: the hyper-parameters of a Llama-layout model, read from an HF `config.json`.

Both RoPE spellings are accepted: the old one (`rope_theta` + `rope_scaling`) and the new one
(`rope_parameters` with `rope_type`/`rope_theta`). RoPE scaling of type `llama3` and `linear` is
supported; anything else is refused with a message naming the file and the type.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
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
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shapes and constants of a Llama-layout decoder (also Mistral without sliding window)."""

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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        try:
            return cls.from_dict(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build from an HF config dict; raises ValueError naming the offending key."""
        architecture = _architecture(raw)
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        if architecture == "MistralForCausalLM" and raw.get("sliding_window") is not None:
            raise ValueError("MistralForCausalLM with sliding_window is not supported "
                             f"(sliding_window={raw['sliding_window']})")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"missing required keys: {', '.join(missing)}")
        num_heads = int(raw["num_attention_heads"])
        rope_theta, rope_scaling = _rope(raw)
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            architecture=architecture,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
        )

    def to_dict(self) -> dict[str, Any]:
        """An HF-style config dict (old rope spelling, which every transformers version reads)."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "mistral" if self.architecture == "MistralForCausalLM" else "llama",
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
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                out["rope_scaling"].update(low_freq_factor=s.low_freq_factor,
                                           high_freq_factor=s.high_freq_factor,
                                           original_max_position_embeddings=s.original_max_position_embeddings)
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type")
        archs = {"llama": ["LlamaForCausalLM"], "mistral": ["MistralForCausalLM"]}.get(model_type, [])
        if not archs:
            raise ValueError(f"no 'architectures' and unknown model_type {model_type!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Return (theta, scaling) from either the old or the new (`rope_parameters`) spelling."""
    params = raw.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    if "factor" not in scaling:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    fields = {k: scaling[k] for k in ("low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings") if k in scaling}
    if rope_type == "linear":
        fields = {}
    return float(theta), RopeScaling(rope_type=rope_type, factor=float(scaling["factor"]), **fields)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
