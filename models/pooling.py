"""Pooling: a prompt's final hidden states -> one embedding vector, as the model's
sentence-transformers configuration says.

`PoolingConfig.from_dir(model_dir)` reads `modules.json` and the Pooling module's `config.json`
(e.g. `1_Pooling/config.json`) when present: last-token, mean or CLS (first-token) pooling, and a
`Normalize` module means L2 normalisation. Without them the default is vLLM's for a decoder used
as an embedding model: last token, normalised. Modules we do not compute (Dense projections, max /
weighted-mean pooling, include_prompt false) are refused by name, never skipped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST = "sentence_transformers.models."
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How hidden states [T, E] become one vector: `pooling_type` LAST | MEAN | CLS, then L2
    normalisation when `normalize`."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> PoolingConfig:
        """The sentence-transformers pooling of `model_dir` (modules.json), else the default."""
        if model_dir is None or not (Path(model_dir) / "modules.json").is_file():
            return cls()
        model_dir = Path(model_dir)
        modules = _read_json(model_dir / "modules.json")
        if not isinstance(modules, list):
            raise ValueError(f"{model_dir / 'modules.json'}: expected a list of modules")
        pooling_type, normalize = "LAST", False
        for module in modules:
            kind = str(module.get("type", "")).removeprefix(_ST) if isinstance(module, dict) else ""
            if kind == "Pooling":
                pooling_type = _st_pooling_type(model_dir / module.get("path", "") / "config.json")
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise ValueError(f"{model_dir / 'modules.json'}: sentence-transformers module {kind or module!r} "
                                 "is not supported (only Transformer, Pooling and Normalize)")
        return cls(pooling_type, normalize)

    def with_overrides(self, overrides: Any) -> PoolingConfig:
        """vLLM's `pooler_config`: a dict or an object with pooling_type / normalize (None keeps ours)."""
        if overrides is None:
            return self
        get = overrides.get if isinstance(overrides, dict) else lambda name: getattr(overrides, name, None)
        if isinstance(overrides, dict):
            unknown = sorted(set(overrides) - {"pooling_type", "normalize"})
            if unknown:
                raise ValueError(f"pooler_config field(s) {', '.join(unknown)} not supported "
                                 "(supported: pooling_type, normalize)")
        pooling_type = get("pooling_type")
        normalize = get("normalize")
        return PoolingConfig(self.pooling_type if pooling_type is None else str(pooling_type).upper(),
                             self.normalize if normalize is None else normalize)


def pool(hidden: np.ndarray, config: PoolingConfig) -> np.ndarray:
    """One prompt's final hidden states [T, E] -> its embedding [E] (float32)."""
    hidden = np.asarray(hidden, dtype=np.float32)  # [T, E]
    if config.pooling_type == "LAST":
        vector = hidden[-1]  # [E]
    elif config.pooling_type == "CLS":
        vector = hidden[0]  # [E]
    else:
        vector = hidden.mean(axis=0)  # [E]
    if config.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)


def _st_pooling_type(path: Path) -> str:
    settings = _read_json(path)
    unsupported = [k for k in _ST_UNSUPPORTED if settings.get(k)]
    if unsupported or settings.get("include_prompt", True) is False:
        name = unsupported[0] if unsupported else "include_prompt: false"
        raise ValueError(f"{path}: {name} is not supported (supported: last-token, mean and CLS pooling)")
    chosen = [mode for key, mode in _ST_MODES.items() if settings.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"{path}: expected exactly one pooling mode of {', '.join(_ST_MODES)}, got {chosen or 'none'}")
    return chosen[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (named by modules.json)") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
