"""ArchSpec: what one HF architecture computes beyond the shared Llama-layout decoder.

The decoder (models/llama.py), the expected tensors (models/weight_spec.py) and the config checks
(models/config.py) consult the spec; nothing else knows which family a model belongs to. Defaults are
transformers' own class defaults, used when config.json leaves a key out (older transformers wrote
only the keys that differed from them).

`window_switch` names the config key that turns a sliding window on:
- "sliding_window": Mistral, the same window on every layer unless the key is null (the class
  default is 4096). Computed: LlamaConfig.sliding_window bounds what the attention reads.
- "use_sliding_window": Qwen2/Qwen3, a window on layers >= max_window_layers when true, or on every
  layer that `layer_types` marks "sliding_attention". Not computed (a per-layer window): a config
  asking for one is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """One architecture's differences from Llama, as flags the decoder and the weight list read."""

    architecture: str  # the `architectures` entry of config.json
    model_type: str
    qkv_bias: bool = False  # q/k/v projections carry biases (o_proj and the MLP never do)
    qk_norm: bool = False  # RMSNorm of every q and k head over head_dim, before RoPE
    default_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    default_max_position_embeddings: int = 2048
    default_tie_word_embeddings: bool = False
    window_switch: str | None = None
    default_sliding_window: int | None = None  # the window a config without the key gets


ARCH_SPECS: dict[str, ArchSpec] = {spec.architecture: spec for spec in (
    ArchSpec("LlamaForCausalLM", "llama"),
    ArchSpec("MistralForCausalLM", "mistral", default_max_position_embeddings=4096 * 32,
             window_switch="sliding_window", default_sliding_window=4096),
    ArchSpec("Qwen2ForCausalLM", "qwen2", qkv_bias=True, default_max_position_embeddings=32768,
             window_switch="use_sliding_window", default_sliding_window=4096),
    ArchSpec("Qwen3ForCausalLM", "qwen3", qk_norm=True, default_head_dim=128,
             default_max_position_embeddings=32768, window_switch="use_sliding_window",
             default_sliding_window=4096),
)}
SUPPORTED_ARCHITECTURES = tuple(ARCH_SPECS)
ARCHITECTURE_OF_MODEL_TYPE = {spec.model_type: spec.architecture for spec in ARCH_SPECS.values()}


def arch_spec(architecture: str) -> ArchSpec:
    """The spec of a supported architecture name; ValueError listing the supported ones otherwise."""
    try:
        return ARCH_SPECS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r} "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})") from None
