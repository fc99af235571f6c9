"""load_model: an HF directory, a .gguf file or the default model -> LoadedModel.

Only safetensors and GGUF are read; a directory holding only pickle checkpoints (*.bin, *.pt) is
refused. Every error names the file and the problem.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import LlamaConfig
from .safetensors_io import read_safetensors
from .tokenizer import Tokenizer
from .weight_spec import check_weights, expected_weight_shapes


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Everything needed to build a `Llama` and talk to it. `weights` uses HF tensor names."""

    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer
    source: str


def load_model(name_or_path: str | Path | None = None) -> LoadedModel:
    """None or "default": SmolLM2-135M-Instruct (pulled and converted on first use);
    a path ending in .gguf: imported from GGUF; otherwise an HF model directory."""
    if name_or_path is None or str(name_or_path) == "default":
        from .default_model import ensure_default_model

        return load_hf_dir(ensure_default_model())
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        from .gguf_import import import_gguf

        config, weights, tokenizer = import_gguf(path)
        return LoadedModel(config, weights, tokenizer, str(path))
    if path.is_dir():
        return load_hf_dir(path)
    raise FileNotFoundError(f"{path}: no such model; expected an HF model directory (config.json + "
                            "*.safetensors + tokenizer.json), a .gguf file, or 'default'")


def load_hf_dir(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    config = LlamaConfig.from_file(directory / "config.json")
    weights = read_weights(directory, config)
    tokenizer = Tokenizer.from_dir(directory, extra_eos_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
    return LoadedModel(config, weights, tokenizer, str(directory))


def read_weights(directory: Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """The tensors the config needs, from one or several (indexed) safetensors files, shape-checked."""
    wanted = set(expected_weight_shapes(config))
    weights: dict[str, np.ndarray] = {}
    for path in _safetensors_files(directory):
        for name, array in read_safetensors(path, wanted).items():
            weights[name] = array
            try:
                check_weights_one(config, name, array.shape)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
    check_weights(config, {n: w.shape for n, w in weights.items()}, where=str(directory))
    return weights


def check_weights_one(config: LlamaConfig, name: str, shape: tuple[int, ...]) -> None:
    expected = expected_weight_shapes(config)[name]
    if tuple(shape) != expected:
        raise ValueError(f"tensor {name} has shape {tuple(shape)}, expected {expected} from config.json")


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: malformed safetensors index ({exc})") from None
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles:
        raise ValueError(f"{directory}: only pickle checkpoints found ({', '.join(pickles)}); they are never "
                         "read (arbitrary code execution). Convert the model to safetensors first.")
    raise FileNotFoundError(f"{directory}: no *.safetensors weights found")
