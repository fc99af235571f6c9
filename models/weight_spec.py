"""The HF tensor names and shapes a Llama-layout checkpoint must contain (used by Llama and the loader)."""
from __future__ import annotations

from .config import LlamaConfig


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
    return shapes


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
