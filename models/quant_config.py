"""Fp8CheckpointConfig: the `quantization_config` of a pre-quantized FP8 checkpoint, validated; every other
quantization config refused by name.

Two formats load (both e4m3 weights, `X.weight` F8_E4M3 [out, in], with a float scale `X.weight_scale`):
- vLLM / HF `quant_method: "fp8"`: per-tensor weight scales (`weight_scale`, or `weight_scale_inv`: the
  same multiplier under the name HF's fine-grained FP8 uses), activations `activation_scheme` "dynamic"
  (per token at each product) or "static" (`X.input_scale`, one per tensor); skipped modules in
  `ignored_layers` or `modules_to_not_convert`. Block-wise scales (`weight_block_size`) are refused.
- compressed-tensors (`quant_method: "compressed-tensors"`, `format` "float-quantized" or
  "naive-quantized"): one config group targeting `Linear` with weights `type: "float", num_bits: 8`,
  strategy "tensor" or "channel" (`weight_scale` [out, 1]), and input activations FP8 too, either dynamic
  per token or static per tensor (`input_scale`); skipped modules in `ignore`; `kv_cache_scheme` FP8 per
  tensor or null (the KV scales themselves are tensors: models/checkpoint_scales.py).

An ignore entry is a module name ("lm_head", "model.layers.0.mlp.down_proj") or a regular expression
after "re:", matched from the start of the name as compressed-tensors and vLLM do.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("fp8", "compressed-tensors")
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")
_SUPPORTED = "supported: FP8 checkpoints, quant_method 'fp8' or 'compressed-tensors' with FP8 weights"


@dataclass(frozen=True, slots=True)
class Fp8CheckpointConfig:
    """What a pre-quantized FP8 checkpoint says about its linears (the checkpoint holds the values)."""

    method: str  # "fp8" | "compressed-tensors"
    static_activations: bool = False  # a static per-tensor `input_scale` per linear, else dynamic per token
    ignore: tuple[str, ...] = ()  # modules kept in 16 bits (names, or "re:" regular expressions)

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(f"quantization method {self.method!r} is not supported ({_SUPPORTED})")
        for entry in self.ignore:
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as exc:
                    raise ValueError(f"quantization_config ignore entry {entry!r} is not a valid regular "
                                     f"expression ({exc})") from None

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint stores linear `module` (e.g. "model.layers.0.self_attn.q_proj") in FP8."""
        return not any(module == entry or (entry.startswith("re:") and re.match(entry[3:], module))
                       for entry in self.ignore)

    @classmethod
    def from_dict(cls, raw: Any) -> Fp8CheckpointConfig:
        """From config.json's `quantization_config`; ValueError naming the method and the field for anything
        that is not an FP8 checkpoint this decoder computes."""
        if not isinstance(raw, dict):
            raise ValueError(f"quantization_config must be an object, got {str(raw)[:40]!r}")
        method = raw.get("quant_method")
        if method == "fp8":
            return _from_fp8(raw)
        if method == "compressed-tensors":
            return _from_compressed_tensors(raw)
        raise ValueError(f"quantization_config (quant_method {repr(method)[:40]}) is not supported ({_SUPPORTED})")

    def to_dict(self) -> dict[str, Any]:
        """A `quantization_config` that `from_dict` reads back to this config."""
        if self.method == "fp8":
            return {"quant_method": "fp8", "activation_scheme": "static" if self.static_activations else "dynamic",
                    "ignored_layers": list(self.ignore)}
        activations = ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
                       if self.static_activations else
                       {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True})
        group = {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                 "input_activations": activations, "output_activations": None}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": group}, "ignore": list(self.ignore), "kv_cache_scheme": None}


def _from_fp8(raw: dict[str, Any]) -> Fp8CheckpointConfig:
    block = raw.get("weight_block_size")
    if block is not None:
        raise ValueError(f"quantization_config (quant_method 'fp8'): block-wise scales (weight_block_size "
                         f"{str(block)[:40]}) are not supported; per-tensor and per-channel FP8 are")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config (quant_method 'fp8'): activation_scheme {str(scheme)[:40]!r} is not "
                         "supported (dynamic or static)")
    ignore = _names(raw, "ignored_layers") + _names(raw, "modules_to_not_convert")
    return Fp8CheckpointConfig("fp8", scheme == "static", ignore)


def _from_compressed_tensors(raw: dict[str, Any]) -> Fp8CheckpointConfig:
    base = where = "quantization_config (quant_method 'compressed-tensors')"
    fmt = raw.get("format")
    if fmt not in COMPRESSED_FORMATS:
        raise ValueError(f"{where}: format {str(fmt)[:40]!r} is not supported (FP8: {', '.join(COMPRESSED_FORMATS)})")
    if raw.get("sparsity_config"):
        raise ValueError(f"{where}: sparsity_config (sparse weights) is not supported")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"{where}: exactly one config group is supported, got {str(groups)[:60]}")
    (name, group), = groups.items()
    if not isinstance(group, dict):
        raise ValueError(f"{where}: config group {name!r} must be an object")
    where = f"{where} group {name!r}"
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}: targets {str(group.get('targets'))[:60]} are not supported (only ['Linear'])")
    if group.get("format") not in (None, *COMPRESSED_FORMATS):
        raise ValueError(f"{where}: format {str(group.get('format'))[:40]!r} is not supported")
    _fp8_args(where, "weights", group.get("weights"), ("tensor", "channel"), dynamic=False)
    activations = group.get("input_activations")
    if activations is None:
        raise ValueError(f"{where}: weight-only FP8 (input_activations null, W8A16) is not supported; "
                         "FP8 activations are (dynamic per token or static per tensor)")
    dynamic = activations.get("dynamic") if isinstance(activations, dict) else None
    _fp8_args(where, "input_activations", activations, ("token",) if dynamic else ("tensor",), dynamic=bool(dynamic))
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}: output_activations quantization is not supported")
    kv = raw.get("kv_cache_scheme")
    if kv is not None:
        _fp8_args(base, "kv_cache_scheme", kv, ("tensor",), dynamic=False)
    return Fp8CheckpointConfig("compressed-tensors", not dynamic, _names(raw, "ignore"))


def _fp8_args(where: str, key: str, args: Any, strategies: tuple[str, ...], dynamic: bool) -> None:
    """Refuse, naming `key` and the value, quantization args other than symmetric FP8 (float, 8 bits) with
    one of `strategies` and the given `dynamic`."""
    if not isinstance(args, dict):
        raise ValueError(f"{where}: {key} must be an object, got {str(args)[:40]!r}")
    kind, bits = args.get("type"), args.get("num_bits")
    if kind != "float" or bits != 8:
        raise ValueError(f"{where}: {key} type {str(kind)[:20]!r} num_bits {str(bits)[:10]} is not supported "
                         "(only FP8: type 'float', num_bits 8)")
    strategy = args.get("strategy")
    if strategy not in strategies or bool(args.get("dynamic", False)) != dynamic:
        raise ValueError(f"{where}: {key} strategy {str(strategy)[:20]!r} with dynamic {args.get('dynamic')!r} is "
                         f"not supported (supported: {' or '.join(strategies)}, dynamic {dynamic})")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{where}: {key} asymmetric (symmetric false) quantization is not supported")
    for extra in ("group_size", "block_structure"):
        if args.get(extra) is not None:
            raise ValueError(f"{where}: {key} {extra} {str(args[extra])[:20]} is not supported")


def _names(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config {key} must be a list of module names, got {str(value)[:60]!r}")
    return tuple(value)
