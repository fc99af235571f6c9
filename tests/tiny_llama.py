"""Test helper: a tiny random Llama (or Mistral, Qwen2, Qwen3) saved as a real HF directory, built
with transformers' own config and model classes, and transformers' logits for it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False)


# family -> (transformers config class, model class, overrides of TINY)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # head_dim 12 != hidden_size / heads (8): Qwen3 takes head_dim from the config, as the real ones do.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 12}),
}


def make_tiny_hf_model(path: Path, seed: int = 0, family: str = "llama", dtype=None, **overrides):
    """Build the family's *ForCausalLM from `seed`, widen its weights so activations are O(1) (the
    default 0.02-std init would make every logit nearly equal and hide bugs), save it as safetensors
    (in `dtype`, e.g. torch.bfloat16, when given). Returns the float32 model."""
    import torch
    import transformers

    config_name, model_name, family_overrides = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**(TINY | family_overrides | overrides),
                                                 attn_implementation="eager")
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * (0.5 / param.shape[-1] ** 0.5 if param.ndim == 2 else 1))
            if "embed_tokens" in name:
                param.mul_(param.shape[-1] ** 0.5)
    if dtype is None:
        model.save_pretrained(path, safe_serialization=True)
        return model
    # Read back in float32, so the returned model holds exactly what was saved (rounded weights) and
    # fresh float32 buffers (a round trip through `dtype` would also round the RoPE frequencies).
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return getattr(transformers, model_name).from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """transformers' logits for one unpadded sequence: [L, V] in the model's dtype, as numpy."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=False).logits[0]
    return out.numpy()


def random_prompts(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with `vocab_size` entries (ids 0-2 special) and a ChatML template."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
