"""Random weights for benchmark shape presets: a LoadedModel with no checkpoint behind it.

Engines benchmark throughput this way (vLLM's `load_format="dummy"`): the work per token depends on
the shapes, not on the values. Weights are drawn from a seed with the backend's own array module
(`xp`: numpy on the CPU, cupy on CUDA) directly in the target dtype, one tensor at a time, so an
8B-shape model never exists as host float32. numpy and cupy draw different numbers for one seed;
each is reproducible on its own.

Values follow the HF initialisation (linear and embedding weights ~ N(0, 0.02), norm weights 1), so
activations stay finite in float16 through every layer; biases (Qwen2) are drawn like the weights.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .config import LlamaConfig, RopeScaling
from .loader import LoadedModel
from .weight_spec import expected_weight_shapes

INIT_STD = 0.02

_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

# The published configs of the models the presets are named after (HF config.json values).
PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 32.0, **_LLAMA3_ROPE),
        max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, **_LLAMA3_ROPE),
        max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # Too big for one H200 in bf16 (~141 GB): the tensor-parallel shape (TP=2 shards it).
    "llama-3.1-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, **_LLAMA3_ROPE),
        max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # not a published model: a toy shape for tests and CPU smoke runs of the benchmark's plumbing
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,)),
    # nano-vllm's benchmark model: per-head q/k norm, head_dim 128 (not hidden / heads), tied.
    "qwen3-0.6b": LlamaConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        architecture="Qwen3ForCausalLM", bos_token_id=151643, eos_token_ids=(151645, 151643)),
    # Qwen2.5-7B-Instruct: q/k/v biases, untied.
    "qwen2.5-7b": LlamaConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        architecture="Qwen2ForCausalLM", bos_token_id=151643, eos_token_ids=(151645, 151643)),
    # Mistral-7B-v0.1: a 4096-token sliding window (the bench's contexts stay inside it; longer ones read
    # only the window).
    "mistral-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        architecture="MistralForCausalLM", bos_token_id=1, eos_token_ids=(2,), sliding_window=4096),
}


class DummyTokenizer:
    """Stands in for a tokenizer when the weights are random: there is no vocabulary to speak of.

    Prompts must be given as token ids; `decode` returns "" (benchmarks count tokens, not text).
    `token_bytes` is a synthetic table of the usual shape (ids < 256 one byte each, the rest word pieces of
    2-6 letters, a third of them with a leading space), so a structured-output bench has a vocabulary to mask.
    """

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.special_token_ids = tuple(sorted(self.eos_token_ids))

    @staticmethod
    def token_bytes(token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        n = token_id - 256
        letters = bytes(97 + (n * 2654435761 >> (5 * i)) % 26 for i in range(2 + n % 5))
        return b" " + letters if n % 3 == 0 else letters

    def encode(self, text: str) -> list[int]:
        raise ValueError("a model with --dummy-weights has no tokenizer; give prompts as "
                         "prompt_token_ids (or use the random workload)")

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return ""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        raise ValueError("a model with --dummy-weights has no chat template; give prompt_token_ids")


def preset_config(preset: str) -> LlamaConfig:
    """The LlamaConfig of a preset name; ValueError listing the presets for an unknown one."""
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown dummy-weights preset {preset!r}; choose from "
                         f"{', '.join(PRESETS)}") from None


def dummy_model(preset: str, xp: Any = np, dtype: Any = np.float32, seed: int = 0) -> LoadedModel:
    """A LoadedModel of `preset`'s shapes with seeded random weights made by `xp` in `dtype`."""
    config = preset_config(preset)
    return LoadedModel(config, random_weights(config, xp, dtype, seed),
                       DummyTokenizer(config.eos_token_ids), f"dummy:{preset}:seed={seed}")


def random_weights(config: LlamaConfig, xp: Any = np, dtype: Any = np.float32,
                   seed: int = 0) -> dict[str, Any]:
    """HF-named tensors ([out, in] for linears) on `xp`'s device in `dtype`.

    Each tensor is drawn in float32 and cast at once, so the float32 transient is one tensor.
    """
    rng = xp.random.default_rng(seed)
    weights: dict[str, Any] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = xp.ones(shape, dtype=dtype)
            continue
        drawn = rng.standard_normal(shape, dtype=xp.float32)  # [out, in] float32, transient
        drawn *= INIT_STD
        weights[name] = drawn.astype(dtype)
        del drawn
    return weights


def num_parameters(config: LlamaConfig) -> int:
    """Parameters of the model (a tied embedding counted once)."""
    return sum(int(np.prod(shape)) for shape in expected_weight_shapes(config).values())
