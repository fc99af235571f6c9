"""Test helper: tiny pre-quantized FP8 checkpoints, written the way vLLM / llm-compressor lay them out.

`write_plain_model(dir)`: write_tiny_model's float32 model with q_proj scaled by 0.1 (the tests' "smooth" model:
the random model's very sharp attention would amplify any rounding far beyond what it costs a trained model).
`write_fp8_checkpoint(plain, dir, ...)`: the same model with its linears in F8_E4M3 and their scales, the
config.json carrying a realistic `quantization_config` (both formats), tokenizer files copied; static input
scales calibrated on the 16-bit model (`calibrated_input_scales`).
Written by the safetensors package (F8_E4M3 from ml_dtypes.float8_e4m3fn), read back by our reader (the package's
NumPy reader has no float8). `add_tensors(dir, tensors)`: rewrite a directory's model.safetensors with extra tensors (k_scale / v_scale).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from fixtures_tiny_model import write_tiny_model
from safetensors.numpy import save_file

from offline_paged.models.checkpoint_scales import FUSED_LINEARS, quantized_modules
from offline_paged.models.config import LlamaConfig
from offline_paged.models.llama import Llama
from offline_paged.models.loader import load_model
from offline_paged.models.safetensors_io import read_safetensors
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.fp8_linear import Fp8Linear, fp8_scales
from offline_paged.ops.kv_scales import quantize_fp8
from offline_paged.ops.ops_numpy import NumpyOps

WEIGHTS = "model.safetensors"


def write_plain_model(directory: Path, seed: int = 0) -> Path:
    write_tiny_model(directory, seed)
    weights = read_safetensors(directory / WEIGHTS)
    save_file({n: (w * np.float32(0.1) if "q_proj" in n else w) for n, w in weights.items()}, str(directory / WEIGHTS))
    return directory


def _fp8_args(strategy: str, dynamic: bool) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def quantization_config(method: str, strategy: str = "channel", static: bool = False, ignore=("lm_head",)) -> dict:
    """A realistic config.json `quantization_config` (llm-compressor's FP8_DYNAMIC / FP8 schemes, vLLM's fp8)."""
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "ignored_layers": list(ignore)}
    group = {"targets": ["Linear"], "weights": _fp8_args(strategy, False),
             "input_activations": _fp8_args("tensor", False) if static else _fp8_args("token", True),
             "output_activations": None, "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
            "sparsity_config": {}, "global_compression_ratio": None, "version": "0.9.1"}


def quantize_weight(w: np.ndarray, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float32 -> (e4m3 [out, in], scale: [out, 1] per channel (Fp8Linear.quantize's) or [] per tensor)."""
    if strategy == "channel":
        layer = Fp8Linear.quantize(w.T)
        return np.ascontiguousarray(layer.weight.T), layer.weight_scale.reshape(-1, 1)
    scale = fp8_scales(np.abs(w).max())  # []
    return quantize_fp8(w / scale, 1.0), scale


class _AmaxObserver:
    """Stands in for a linear weight [in, out] and records max |x| of what multiplies it (a minmax observer)."""

    __array_ufunc__ = None  # NumPy defers `x @ observer` to __rmatmul__

    def __init__(self, weight):
        self.weight, self.amax = weight, 0.0

    def __rmatmul__(self, x):
        self.amax = max(self.amax, float(np.abs(x).max()))
        return x @ self.weight


def calibrated_input_scales(plain: Path) -> dict[str, float]:
    """Static activation scales as llm-compressor's minmax observer takes them: max |input| / 448 of every linear
    over a calibration batch through the 16-bit model (the parts of a fused linear see the same input)."""
    loaded = load_model(plain)
    model = Llama(loaded.config, loaded.weights, NumpyOps())
    observers = {}
    for i, layer in enumerate(model.layers):
        for fused in FUSED_LINEARS:
            observers[(i, fused)] = _AmaxObserver(getattr(layer, fused))
            setattr(layer, fused, observers[(i, fused)])
    rng = np.random.default_rng(11)
    SimpleRunner(model, 64, 4).step([(i, rng.integers(0, 256, 40).tolist()) for i in range(4)])
    return {f"model.layers.{i}.{part}": observer.amax / 448 for (i, fused), observer in observers.items()
            for part in FUSED_LINEARS[fused]}


def write_fp8_checkpoint(plain: Path, directory: Path, method: str = "compressed-tensors", strategy: str = "channel",
                         static: bool = False, ignore=("lm_head",), scale_name: str = "weight_scale",
                         qconfig: dict | None = None) -> Path:
    """`plain`'s model with every linear its quantization config does not ignore stored as FP8."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in plain.iterdir():
        if path.name != WEIGHTS:
            shutil.copy(path, directory / path.name)
    raw = json.loads((plain / "config.json").read_text())
    raw["quantization_config"] = qconfig or quantization_config(method, strategy, static, ignore)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    config = LlamaConfig.from_dict(raw)
    tensors = read_safetensors(plain / WEIGHTS)
    input_scales = calibrated_input_scales(plain) if static else {}
    for module in quantized_modules(config):
        tensors[f"{module}.weight"], tensors[f"{module}.{scale_name}"] = quantize_weight(tensors[f"{module}.weight"],
                                                                                          strategy)
        if static:
            tensors[f"{module}.input_scale"] = np.array(input_scales[module], dtype=np.float32)
    save_file(tensors, str(directory / WEIGHTS))
    return directory


def add_tensors(directory: Path, tensors: dict[str, np.ndarray], drop: tuple[str, ...] = ()) -> Path:
    """Rewrite `directory`'s weights with `tensors` added (and the names in `drop` removed)."""
    weights = {n: w for n, w in read_safetensors(directory / WEIGHTS).items() if n not in drop}
    save_file(weights | tensors, str(directory / WEIGHTS))
    return directory
