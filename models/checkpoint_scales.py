"""The scale tensors a checkpoint may hold beside its weights: the FP8 weight and activation scales of a
pre-quantized checkpoint's linears (models/quant_config.py) and per-layer KV-cache scales.

Linears, HF module names under `model.layers.N.`: self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj, fused
by the model into qkv (q, k, v), o_proj, gate_up (gate, up) and down. A fused linear's parts are all FP8 or
all 16-bit: a checkpoint that ignores only some of them is refused (vLLM refuses it too).
A quantized module X holds `X.weight` (F8_E4M3, [out, in]) and `X.weight_scale` (or `X.weight_scale_inv`, HF's
name for the same multiplier), of shape [] or [1] (per tensor) or [out] or [out, 1] (per output channel); and
`X.input_scale` ([] or [1]) exactly when its activations are static.
KV scales (optional in any checkpoint; the model reads them only for an FP8 KV cache): per layer
`self_attn.k_scale` / `self_attn.v_scale` (vLLM's names), else compressed-tensors'
`self_attn.k_proj.output_scale` / `self_attn.v_proj.output_scale`, else the older `self_attn.kv_scale` (both);
one element each.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from .config import LlamaConfig

# The model's fused linears -> the checkpoint modules they are made of (under model.layers.N.).
FUSED_LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "o_proj": ("self_attn.o_proj",),
                 "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                 "down": ("mlp.down_proj",)}
WEIGHT_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
# KV-scale tensor names under model.layers.N., in the order they are looked up.
K_SCALE_NAMES = ("self_attn.k_scale", "self_attn.k_proj.output_scale", "self_attn.kv_scale")
V_SCALE_NAMES = ("self_attn.v_scale", "self_attn.v_proj.output_scale", "self_attn.kv_scale")
SCALAR_SHAPES = ((), (1,))


def quantized_modules(config: LlamaConfig) -> list[str]:
    """Full names of the linears the checkpoint stores in FP8 ([] without a quantization config); ValueError
    for a fused linear whose parts are only partly ignored."""
    quantization = config.quantization
    if quantization is None:
        return []
    modules = []
    for i in range(config.num_hidden_layers):
        for fused, parts in FUSED_LINEARS.items():
            names = [f"model.layers.{i}.{part}" for part in parts]
            flags = [quantization.quantizes(name) for name in names]
            if any(flags) and not all(flags):
                raise ValueError(f"quantization_config ignores only some of {names} (fused as one {fused} "
                                 "linear): they must be all FP8 or all 16-bit")
            modules += names if all(flags) else []
    return modules


def weight_scale_name(module: str, names: Collection[str]) -> str:
    """`module.weight_scale_inv` when the checkpoint has it, else `module.weight_scale`."""
    inverse = f"{module}.weight_scale_inv"
    return inverse if inverse in names else f"{module}.weight_scale"


def scale_tensor_shapes(config: LlamaConfig, names: Collection[str],
                        weight_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The scale tensors a checkpoint with tensor `names` must hold for `config`, each with its allowed
    shapes (`weight_shapes`: the expected weight shapes, [out, in])."""
    required: dict[str, tuple[tuple[int, ...], ...]] = {}
    for module in quantized_modules(config):
        out = weight_shapes[f"{module}.weight"][0]
        required[weight_scale_name(module, names)] = (*SCALAR_SHAPES, (out,), (out, 1))
        if config.quantization.static_activations:
            required[f"{module}.input_scale"] = SCALAR_SHAPES
    return required


def kv_scale_names(config: LlamaConfig) -> set[str]:
    """Every KV-scale tensor name a checkpoint of `config` may hold (all optional)."""
    return {f"model.layers.{i}.{name}" for i in range(config.num_hidden_layers)
            for name in (*K_SCALE_NAMES, *V_SCALE_NAMES)}


def layer_kv_scales(weights: Mapping[str, Any], layer: int) -> tuple[float | None, float | None]:
    """(k_scale, v_scale) of decoder layer `layer` from the checkpoint, None where it has none."""
    return (_first_scalar(weights, layer, K_SCALE_NAMES), _first_scalar(weights, layer, V_SCALE_NAMES))


def scalar(tensor, name: str) -> float:
    """The one value of scale tensor `name` as a float; ValueError naming it unless it is one finite value > 0."""
    value = np.asarray(tensor, dtype=np.float32)
    if value.size != 1 or not np.isfinite(value).all() or not float(value.reshape(())) > 0:
        raise ValueError(f"tensor {name} must hold one positive finite scale, got {value.reshape(-1)[:4]} "
                         f"(shape {value.shape})")
    return float(value.reshape(()))


def _first_scalar(weights: Mapping[str, Any], layer: int, candidates: tuple[str, ...]) -> float | None:
    found = [f"model.layers.{layer}.{name}" for name in candidates if f"model.layers.{layer}.{name}" in weights]
    return scalar(weights[found[0]], found[0]) if found else None


def fused_parts(weights: Mapping[str, Any], read: Callable[[str], Any], prefix: str, fused: str,
                static_activations: bool) -> tuple[list, list, list[float] | None]:
    """The checkpoint tensors of fused linear `fused` of the layer at `prefix` ("model.layers.N."), read
    through `read` (`weights` answers which scale spelling is present): (weights [out_i, in] e4m3, weight
    scales, input scales or None)."""
    modules = [prefix + part for part in FUSED_LINEARS[fused]]
    parts = [read(f"{m}.weight") for m in modules]
    scales = [read(weight_scale_name(m, weights)) for m in modules]
    if not static_activations:
        return parts, scales, None
    return parts, scales, [scalar(read(f"{m}.input_scale"), f"{m}.input_scale") for m in modules]
