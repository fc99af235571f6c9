"""Test helper: write a tiny random Llama as a real HF directory that `load_model(path)` loads.

config.json + model.safetensors (numpy random weights) + tokenizer.json (byte-level BPE with no
merges: one token per byte, plus ChatML specials) + tokenizer_config.json with a ChatML template.
Small enough that a CLI subprocess starts and finishes a job in a few seconds on one core.
"""
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from offline_paged.models.chat_template import ChatTemplate
from offline_paged.models.config import LlamaConfig
from offline_paged.models.tokenizer import Tokenizer
from offline_paged.models.weight_spec import expected_weight_shapes

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 258  # <|im_end|>: ids 0..255 are bytes, then the specials in order
VOCAB_SIZE = 259
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_model(directory: Path, seed: int = 0, max_position_embeddings: int = 256) -> Path:
    """Create the model directory (idempotent for a given seed) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, rope_theta=500.0, eos_token_ids=(EOS_ID,),
                         max_position_embeddings=max_position_embeddings)
    (directory / "config.json").write_text(
        json.dumps(config.to_dict() | {"eos_token_id": EOS_ID}, indent=2))
    save_file(_random_weights(config, seed), str(directory / "model.safetensors"))
    _tokenizer().save(directory)
    return directory


def _random_weights(config: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.3 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            weights[name] = rng.standard_normal(shape)
        else:
            weights[name] = rng.standard_normal(shape) * 1.5 / shape[-1] ** 0.5
    return {name: w.astype(np.float32) for name, w in weights.items()}


# A text the tokenizer of make_tokenizer_panic panics on.
PANIC_TEXT = "a" * 64 + "b"


def make_tokenizer_panic(model_dir: Path) -> None:
    """Put a Split regex in front of model_dir's pre-tokenizer that backtracks past onig's limit on PANIC_TEXT:
    the Rust tokenizer then panics there (pyo3's PanicException, a BaseException), and only there."""
    path = Path(model_dir) / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False},
        tokenizer["pre_tokenizer"]]}
    path.write_text(json.dumps(tokenizer))


def _tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    backend = BackendTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    return Tokenizer(backend, frozenset({EOS_ID}), None, ChatTemplate(CHATML),
                     {"eos_token": "<|im_end|>"})


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-unicode map, inverted: printable bytes map to themselves."""
    code = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
