"""Test helper: write HF-named weights of a llama / qwen2 / qwen3 config as a GGUF file, the way
llama.cpp's converter lays them out (names, reversed shapes, `llama` Q/K rows permuted for its RoPE,
Llama 3.1 RoPE scaling as a rope_freqs.weight tensor of divisors), with the `gguf` package's writer."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from offline_paged.models.config import LlamaConfig, RopeScaling

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    _, _, index, rest = stem.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}.{suffix}"


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (pairs RoPE dims (2i, 2i+1) instead of HF's (i, i + D/2))."""
    rows, cols = weight.shape
    return weight.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama3_divisors(config: LlamaConfig, s: RopeScaling) -> np.ndarray:
    """The rope_freqs.weight values llama.cpp's converter writes for a llama3 rope_scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(1.0)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_family_gguf(path: Path, config: LlamaConfig, weights: dict[str, np.ndarray], tokens: list[str],
                      merges: list[str], pre: str, rope_freqs: np.ndarray | None = None,
                      extra_metadata: dict | None = None) -> Path:
    from gguf import GGUFWriter

    arch = GGUF_ARCH[config.architecture]
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    if arch == "qwen3":
        writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", config.head_dim)
    else:
        writer.add_uint32(f"{arch}.rope.dimension_count", config.head_dim)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [1] * len(tokens))
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.eos_token_id", len(tokens) - 1)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, array in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = permute_rows(array, n_head)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path
