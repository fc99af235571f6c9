"""convert_gguf: write a GGUF model out as an HF directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .config import LlamaConfig
from .gguf_import import import_gguf
from .tokenizer import Tokenizer


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Import `gguf_path` and write it to `out_dir` (created; existing files there are overwritten)."""
    config, weights, tokenizer = import_gguf(gguf_path)
    return write_hf_dir(out_dir, config, weights, tokenizer)


def write_hf_dir(out_dir: str | Path, config: LlamaConfig, weights: dict[str, np.ndarray],
                 tokenizer: Tokenizer) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config.to_dict())
    tensors = {name: np.ascontiguousarray(w) for name, w in sorted(weights.items())}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the mode (umask applied) every other file here gets
    (out_dir / "model.safetensors").chmod((out_dir / "config.json").stat().st_mode & 0o777)
    tokenizer.save(out_dir)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids)}
    _write_json(out_dir / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
    return out_dir


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
