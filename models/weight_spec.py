"""The HF tensor names and shapes a Llama-layout checkpoint must contain (used by Llama and the loader).

The architecture's `ArchSpec` adds q/k/v biases (Qwen2) or per-head q/k norm weights (Qwen3); a tensor
outside this list is refused by the loader, so a checkpoint of another family never loads silently. Scale
tensors (a pre-quantized FP8 checkpoint's, required; KV-cache scales, optional) are named in
models/checkpoint_scales.py."""
from __future__ import annotations

import re
from collections.abc import Iterable

from .checkpoint_scales import kv_scale_names, scale_tensor_shapes
from .config import LlamaConfig

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
# Tensors some exporters write that carry nothing the model computes with.
_QUANT_SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale")
_IGNORABLE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def count_layers(names: Iterable[str]) -> int:
    """Decoder layers a checkpoint holds: 1 + the highest `model.layers.N.` index (0 if none)."""
    indices = [int(m.group(1)) for m in map(_LAYER_NAME.match, names) if m]
    return max(indices) + 1 if indices else 0


def check_checkpoint_names(config: LlamaConfig, names: set[str]) -> None:
    """Compare the tensor names of a checkpoint with what `config` computes, before anything is read
    or sized from the config: the layer count first (so a hostile num_hidden_layers never sizes
    anything), then tied embeddings, then missing and unexpected tensors, each named.
    Raises ValueError; the caller adds the file names."""
    num_layers = count_layers(names)
    if num_layers != config.num_hidden_layers:
        raise ValueError(f"num_hidden_layers is {config.num_hidden_layers} in config.json, but the checkpoint "
                         f"holds {num_layers} layers")
    expected = expected_weight_shapes(config)
    if not config.tie_word_embeddings and "lm_head.weight" not in names:
        raise ValueError("config.json sets tie_word_embeddings to false, but the checkpoint has no "
                         "lm_head.weight (set it to true if the output layer shares the embeddings)")
    scales = scale_tensor_shapes(config, names, expected)  # a pre-quantized checkpoint's FP8 scales
    missing = sorted((set(expected) | set(scales)) - names)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"missing tensors {missing[:5]}{more}")
    allowed = set(expected) | set(scales) | kv_scale_names(config)
    allowed |= {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in names - allowed if not _IGNORABLE.fullmatch(n))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        scales = config.quantization is None and any(n.endswith(_QUANT_SCALES) for n in unexpected)
        why = ("FP8 scales, but config.json has no quantization_config" if scales else
               "a checkpoint of another architecture?")
        raise ValueError(f"unexpected tensors {unexpected[:5]}{more}: a {config.architecture} as configured "
                         f"does not use them ({why}); refusing to compute a different model")


def expected_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape ([out, in] for linear layers). `lm_head.weight` only when embeddings are untied."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        shapes |= _arch_extras(config, p)
    return shapes


def _arch_extras(config: LlamaConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The tensors of layer prefix `p` that the architecture adds to the Llama layout."""
    spec, head_dim = config.spec, config.head_dim
    extras: dict[str, tuple[int, ...]] = {}
    if spec.qkv_bias:
        extras |= {p + "self_attn.q_proj.bias": (config.num_attention_heads * head_dim,),
                   p + "self_attn.k_proj.bias": (config.num_key_value_heads * head_dim,),
                   p + "self_attn.v_proj.bias": (config.num_key_value_heads * head_dim,)}
    if spec.qk_norm:
        extras |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    return extras


def check_weights(config: LlamaConfig, shapes: dict[str, tuple[int, ...]], where: str = "weights") -> None:
    """Raise ValueError listing missing tensors or wrong shapes; extra tensors are ignored
    (e.g. rotary inv_freq buffers, a redundant lm_head.weight of a tied model)."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{where}: missing tensors {missing[:5]}{more}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: tensor {name} has shape {tuple(shapes[name])}, expected {shape}")
