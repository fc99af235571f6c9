"""Test helper: a tiny llama-architecture GGUF (random F32 weights, a byte-level BPE vocabulary of
single characters), written with the `gguf` package, with any metadata key overridden or dropped."""
from __future__ import annotations

from pathlib import Path

import numpy as np

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list("abcdefghijklmnopqrstuvwxyzĠ") + ["ab", "Ġa"]
SHAPE = dict(hidden=16, heads=2, kv_heads=1, head_dim=8, inter=24, layers=2)
_DROP = object()


def write_tiny_gguf(path: Path, overrides: dict | None = None, extra_tensors: dict | None = None,
                    num_layers: int | None = None, seed: int = 0) -> Path:
    """`overrides`: {key: value or DROP}; values are written with the writer's typed adders (see _put)."""
    from gguf import GGUFWriter

    s = SHAPE
    layers = s["layers"] if num_layers is None else num_layers
    meta = {
        "llama.block_count": layers, "llama.context_length": 64, "llama.embedding_length": s["hidden"],
        "llama.feed_forward_length": s["inter"], "llama.attention.head_count": s["heads"],
        "llama.attention.head_count_kv": s["kv_heads"], "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(TOKENS) - 3),
        "tokenizer.ggml.merges": ["a b", "Ġ a"], "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    } | (overrides or {})
    writer = GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if value is not _DROP:
            _put(writer, key, value)
    rng = np.random.default_rng(seed)
    for name, shape in _tensor_shapes(layers).items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


DROP = _DROP


def _put(writer, key, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if 0 <= value < 2**32 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    s = SHAPE
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes = {"token_embd.weight": (len(TOKENS), s["hidden"]), "output_norm.weight": (s["hidden"],)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (s["hidden"],), f"blk.{i}.ffn_norm.weight": (s["hidden"],),
                   f"blk.{i}.attn_q.weight": (q, s["hidden"]), f"blk.{i}.attn_k.weight": (kv, s["hidden"]),
                   f"blk.{i}.attn_v.weight": (kv, s["hidden"]), f"blk.{i}.attn_output.weight": (s["hidden"], q),
                   f"blk.{i}.ffn_gate.weight": (s["inter"], s["hidden"]),
                   f"blk.{i}.ffn_up.weight": (s["inter"], s["hidden"]),
                   f"blk.{i}.ffn_down.weight": (s["hidden"], s["inter"])}
    return shapes
