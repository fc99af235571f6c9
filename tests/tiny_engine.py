"""Test helper: a tiny random Llama built straight from numpy (no torch) and a byte-level fake tokenizer,
packaged like models.loader.LoadedModel so LLMEngine can take it as `loaded_model`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from offline_paged.core.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.models.config import LlamaConfig
from offline_paged.models.weight_spec import expected_weight_shapes

EOS_ID = 1
VOCAB_SIZE = 260  # ids 4..259 are the bytes 0..255; 0..3 are specials (1 = EOS)
_BYTE_OFFSET = 4


class ByteTokenizer:
    """Token id 4+b is byte b; ids 0..3 are special and decode to nothing, and so do ids past the byte
    range (random models of a real vocabulary size sample them)."""

    eos_token_ids = frozenset({EOS_ID})
    special_token_ids = tuple(range(_BYTE_OFFSET))

    def token_bytes(self, token_id: int) -> bytes:
        """The byte a token stands for (structured output's token table); specials stand for nothing."""
        return bytes([token_id - _BYTE_OFFSET]) if _BYTE_OFFSET <= token_id < VOCAB_SIZE else b""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + _BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - _BYTE_OFFSET for i in ids if _BYTE_OFFSET <= i < VOCAB_SIZE)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass(frozen=True, slots=True)
class TinyModel:
    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tokenizer: ByteTokenizer
    source: str = "tiny-random"


def tiny_model(seed: int = 0, num_layers: int = 2, max_position_embeddings: int = 512, **shape) -> TinyModel:
    """Random weights scaled so activations stay O(1) and logits are far from uniform. `shape`: LlamaConfig
    fields to override (e.g. head_dim=64 with wider hidden sizes for the CUDA kernels)."""
    config = LlamaConfig(**dict(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=500.0,
        max_position_embeddings=max_position_embeddings, eos_token_ids=(EOS_ID,),
    ) | shape)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        elif "embed_tokens" in name:
            weights[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * 1.5 / shape[-1] ** 0.5).astype(np.float32)
    return TinyModel(config, weights, ByteTokenizer())


def tiny_engine(model: TinyModel | None = None, **config_overrides) -> LLMEngine:
    """An engine on the CPU in float64 (so batch composition cannot flip a near-tie)."""
    settings = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=256,
                    max_num_seqs=16, max_num_batched_tokens=64) | config_overrides
    return LLMEngine(EngineConfig(**settings), loaded_model=model or tiny_model())


def run_to_completion(engine: LLMEngine, requests: dict[str, tuple[list[int], object]]) -> dict:
    """Add every (prompt_token_ids, params) request, step until done; {request_id: RequestOutput}."""
    for request_id, (prompt_ids, params) in requests.items():
        engine.add_request(request_id, prompt_token_ids=prompt_ids, params=params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id] = output
    return results
