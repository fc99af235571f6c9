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
from .safetensors_io import SafetensorsFile
from .tokenizer import Tokenizer
from .weight_spec import check_checkpoint_names, expected_weight_shapes


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


def load_tokenizer(name_or_path: str | Path | None = None) -> tuple[LlamaConfig, Tokenizer]:
    """The config and tokenizer of what `load_model` would load, without reading any weights (a
    data-parallel coordinator renders chat templates and decodes while its workers hold the model)."""
    if name_or_path is None or str(name_or_path) == "default":
        from .default_model import ensure_default_model

        name_or_path = ensure_default_model()
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        from .gguf_import import GgufMetadata, config_from_metadata, open_gguf
        from .gguf_tokenizer import build_tokenizer

        reader = open_gguf(path)
        metadata = GgufMetadata(reader, path)
        config = config_from_metadata(metadata, any(t.name == "output.weight" for t in reader.tensors))
        return config, build_tokenizer(metadata, config)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model; expected an HF model directory (config.json + "
                                "*.safetensors + tokenizer.json), a .gguf file, or 'default'")
    config = LlamaConfig.from_file(path / "config.json")
    return config, Tokenizer.from_dir(path, extra_eos_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)


def load_hf_dir(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    config = LlamaConfig.from_file(directory / "config.json")
    weights = read_weights(directory, config)
    tokenizer = Tokenizer.from_dir(directory, extra_eos_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    for kind, ids in (("end-of-sequence", sorted(tokenizer.eos_token_ids)), ("beginning-of-sequence", bos)):
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise ValueError(f"{directory}: {kind} token id {bad[0]} (from tokenizer_config.json or "
                             f"generation_config.json) is outside the vocabulary (vocab_size {config.vocab_size} "
                             "in config.json)")
    return LoadedModel(config, weights, tokenizer, str(directory))


def read_weights(directory: Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """The tensors the config needs, from one or several (indexed) safetensors files. Every header is
    validated and the names and shapes are checked against the config before any tensor is read."""
    files = _index_tensors([SafetensorsFile(path) for path in _safetensors_files(directory)])
    try:
        check_checkpoint_names(config, set(files))
    except ValueError as exc:
        shards = ", ".join(sorted({f.path.name for f in files.values()}))
        raise ValueError(f"{directory} (config.json; {shards or 'no tensors'}): {exc}") from None
    expected = expected_weight_shapes(config)
    for name, shape in expected.items():
        if files[name].entries[name].shape != shape:
            raise ValueError(f"{files[name].path}: tensor {name} has shape {files[name].entries[name].shape}, "
                             f"expected {shape} from config.json")
    weights = {name: files[name].read(name) for name in expected}
    if config.tie_word_embeddings and "lm_head.weight" in files:
        _check_tied(files["lm_head.weight"], weights["model.embed_tokens.weight"])
    return weights


def _index_tensors(files: list[SafetensorsFile]) -> dict[str, SafetensorsFile]:
    where: dict[str, SafetensorsFile] = {}
    for file in files:
        for name in file.entries:
            if name in where:
                raise ValueError(f"{file.path}: tensor {name} is also in {where[name].path}")
            where[name] = file
    return where


def _check_tied(file: SafetensorsFile, embed: np.ndarray) -> None:
    """A tied model may carry a redundant lm_head.weight; it must then equal the embeddings."""
    entry = file.entries["lm_head.weight"]
    if entry.shape != embed.shape or not np.array_equal(file.read("lm_head.weight"), embed):
        raise ValueError(f"{file.path}: lm_head.weight differs from model.embed_tokens.weight, but config.json "
                         "sets tie_word_embeddings to true (the output layer would silently be the embeddings); "
                         "set tie_word_embeddings to false")


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ValueError(f"{index}: malformed safetensors index ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
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
