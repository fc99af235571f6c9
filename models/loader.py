"""load_model: an HF directory, a .gguf file or the default model -> LoadedModel.

Only safetensors and GGUF are read (a pre-quantized FP8 checkpoint's F8_E4M3 weights and scales too, as
host views: models/checkpoint_scales.py); a directory holding only pickle checkpoints (*.bin, *.pt) is
refused. Every error names the file and the problem.

Two ways to get the weights of an HF directory:
- `load_model(path)`: `weights` is a lazy mapping (name -> read-only view in the checkpoint dtype,
  BF16 as ml_dtypes.bfloat16; see models/checkpoint.py). Nothing is read until a view is touched,
  and `Llama` converts and uploads one tensor at a time, so no full float32 copy exists on the host.
- `load_model(path, xp=cupy, dtype=...)`: `weights` is a dict of `xp` arrays already in `dtype`,
  streamed tensor by tensor (models/weight_upload.py) with a progress bar; peak host RSS stays
  about one tensor above the process's baseline.
For slices of tensors (tensor parallel), use `open_checkpoint` and `to_device` directly.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import Checkpoint, open_checkpoint
from .checkpoint_scales import SCALAR_SHAPES, kv_scale_names, quantized_modules, scale_tensor_shapes
from .config import LlamaConfig
from .hub import resolve_model
from .tokenizer import Tokenizer
from .weight_upload import load_tensors, to_device
from .weight_spec import check_checkpoint_names, expected_weight_shapes


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Everything needed to build a `Llama` and talk to it. `weights` uses HF tensor names: lazy host
    views (`CheckpointWeights`), or arrays of the array module the loader was given."""

    config: LlamaConfig
    weights: Mapping[str, Any]
    tokenizer: Tokenizer
    source: str


def load_model(name_or_path: str | Path | None = None, xp: Any = None, dtype=None,
               progress: bool = True, revision: str | None = None) -> LoadedModel:
    """None or "default": SmolLM2-135M-Instruct (pulled and converted on first use);
    a path ending in .gguf: imported from GGUF; a hub id ("ORG/NAME", at `revision`): its snapshot in
    the Hugging Face cache, downloaded when absent (models/hub.py); otherwise an HF model directory.
    With `xp` (numpy or cupy) the weights are converted to `xp` arrays in `dtype` (default: the
    checkpoint's dtype) while loading; without it they are lazy host views (see the module docstring)."""
    if name_or_path is None or str(name_or_path) == "default":
        from .default_model import ensure_default_model

        return load_hf_dir(ensure_default_model(), xp, dtype, progress)
    path = Path(resolve_model(name_or_path, revision))
    if path.suffix == ".gguf":
        from .gguf_import import import_gguf

        config, weights, tokenizer = import_gguf(path)
        if xp is not None:
            weights = {name: to_device(w, xp, dtype) for name, w in weights.items()}
        return LoadedModel(config, weights, tokenizer, str(path))
    if path.is_dir():
        return load_hf_dir(path, xp, dtype, progress)
    raise FileNotFoundError(f"{path}: no such model; expected an HF model directory (config.json + "
                            "*.safetensors + tokenizer.json), a .gguf file, a hub id (ORG/NAME), or 'default'")


def load_tokenizer(name_or_path: str | Path | None = None,
                   revision: str | None = None) -> tuple[LlamaConfig, Tokenizer]:
    """The config and tokenizer of what `load_model` would load, without reading any weights (a
    data-parallel coordinator renders chat templates and decodes while its workers hold the model)."""
    if name_or_path is None or str(name_or_path) == "default":
        from .default_model import ensure_default_model

        name_or_path = ensure_default_model()
    path = Path(resolve_model(name_or_path, revision))
    if path.suffix == ".gguf":
        from .gguf_import import GgufMetadata, config_from_reader, open_gguf
        from .gguf_tokenizer import build_tokenizer

        reader = open_gguf(path)
        metadata = GgufMetadata(reader, path)
        config = config_from_reader(reader, metadata)
        return config, build_tokenizer(metadata, config)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model; expected an HF model directory (config.json + "
                                "*.safetensors + tokenizer.json), a .gguf file, or 'default'")
    config = LlamaConfig.from_file(path / "config.json")
    return config, Tokenizer.from_dir(path, extra_eos_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)


def load_hf_dir(directory: str | Path, xp: Any = None, dtype=None, progress: bool = True) -> LoadedModel:
    directory = Path(directory)
    config = LlamaConfig.from_file(directory / "config.json")
    weights = read_weights(directory, config, xp, dtype, progress)
    tokenizer = Tokenizer.from_dir(directory, extra_eos_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    for kind, ids in (("end-of-sequence", sorted(tokenizer.eos_token_ids)), ("beginning-of-sequence", bos)):
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise ValueError(f"{directory}: {kind} token id {bad[0]} (from tokenizer_config.json or "
                             f"generation_config.json) is outside the vocabulary (vocab_size {config.vocab_size} "
                             "in config.json)")
    return LoadedModel(config, weights, tokenizer, str(directory))


def read_weights(directory: Path, config: LlamaConfig, xp: Any = None, dtype=None,
                 progress: bool = True) -> Mapping[str, Any]:
    """The tensors the config needs, from one or several (indexed) safetensors files. Every header is
    validated and the names and shapes are checked against the config before any tensor is read.
    Without `xp`: lazy views (`CheckpointWeights`); with it: `xp` arrays in `dtype`, streamed."""
    checkpoint = open_checkpoint(directory)
    try:
        check_checkpoint_names(config, set(checkpoint))
    except ValueError as exc:
        shards = ", ".join(sorted(f.path.name for f in checkpoint.shards if f.entries))
        raise ValueError(f"{directory} (config.json; {shards or 'no tensors'}): {exc}") from None
    expected = expected_weight_shapes(config)
    for name, shape in expected.items():
        if checkpoint.shape(name) != shape:
            raise ValueError(f"{checkpoint.files[name].path}: tensor {name} has shape {checkpoint.shape(name)}, "
                             f"expected {shape} from config.json")
        checkpoint.dtype(name)  # an unsupported dtype fails here, before anything is read
    if config.tie_word_embeddings and "lm_head.weight" in checkpoint:
        _check_tied(checkpoint)
    scales = _check_scales(checkpoint, config, expected)
    names = (*expected, *scales, *sorted(kv_scale_names(config) & set(checkpoint)))
    if xp is None:
        return CheckpointWeights(checkpoint, names)
    if config.quantization is not None:
        raise ValueError(f"{directory}: FP8 checkpoints (quantization_config quant_method "
                         f"{config.quantization.method!r}) load as host views only (device='cpu' for now)")
    return load_tensors(checkpoint, names, xp, dtype, progress)


def _check_scales(checkpoint: Checkpoint, config: LlamaConfig, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """The FP8 scale tensors `config` needs, checked: their shapes and float dtypes, F8_E4M3 for exactly
    the quantized linears' weights (models/checkpoint_scales.py). ValueError naming the file and tensor."""
    fp8_weights = {f"{module}.weight" for module in quantized_modules(config)}
    for name in expected:
        is_fp8 = checkpoint.entry(name).dtype == "F8_E4M3"
        if is_fp8 != (name in fp8_weights):
            why = ("the checkpoint's quantization_config quantizes it" if name in fp8_weights else
                   "config.json's quantization_config does not quantize it" if config.quantization is not None else
                   "config.json has no quantization_config")
            raise ValueError(f"{checkpoint.files[name].path}: tensor {name} has dtype {checkpoint.entry(name).dtype}, "
                             f"but {why} (FP8 weights are F8_E4M3)")
    shapes = scale_tensor_shapes(config, set(checkpoint), expected)
    for name in [*shapes, *(kv_scale_names(config) & set(checkpoint))]:
        allowed = shapes.get(name, SCALAR_SHAPES)
        if checkpoint.shape(name) not in allowed or checkpoint.entry(name).dtype not in ("F32", "BF16", "F16"):
            raise ValueError(f"{checkpoint.files[name].path}: scale tensor {name} has shape {checkpoint.shape(name)} "
                             f"and dtype {checkpoint.entry(name).dtype}; expected a float tensor of shape "
                             f"{' or '.join(str(s) for s in allowed)}")
    return list(shapes)


class CheckpointWeights(Mapping):
    """name -> a fresh lazy view of that tensor (nothing cached, so a consumer that converts one
    tensor at a time holds one tensor's pages at a time). Only the names the config computes."""

    def __init__(self, checkpoint: Checkpoint, names: tuple[str, ...]):
        self.checkpoint = checkpoint
        self._names = dict.fromkeys(names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self.checkpoint[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _check_tied(checkpoint: Checkpoint) -> None:
    """A tied model may carry a redundant lm_head.weight; it must then equal the embeddings."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if checkpoint.shape(head) != checkpoint.shape(embed) or not _equal_in_chunks(checkpoint[head], checkpoint[embed]):
        raise ValueError(f"{checkpoint.files[head].path}: lm_head.weight differs from model.embed_tokens.weight, "
                         "but config.json sets tie_word_embeddings to true (the output layer would silently be "
                         "the embeddings); set tie_word_embeddings to false")


def _equal_in_chunks(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
    return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, len(a), rows))
