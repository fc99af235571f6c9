"""GGUF tokenizers of the Qwen2 family (tokenizer.ggml.pre = 'qwen2') vs transformers' own GGUF
tokenizer conversion on the same file: ids of texts where the split rule and NFC normalization matter.

Qwen2's own tokenizer (its tokenizer.json, and transformers' Qwen2Tokenizer class) NFC-normalizes
before BPE; transformers' GGUF conversion drops that normalizer. We keep it, so the reference here
is transformers' GGUF tokenizer applied to the NFC form of each text."""
from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from offline_paged.models.config import LlamaConfig
from offline_paged.models.gguf_import import GgufMetadata, open_gguf
from offline_paged.models.gguf_tokenizer import build_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# "1 2" and "12 3" only fire when digits are not isolated; "Ã ©" (é as bytes c3 a9) only after NFC
# composes e + U+0301; the rest are ordinary word merges.
MERGES = ["1 2", "12 3", "Ġ t", "h e", "Ġt he", "Ã ©", "c a", "ca f", "Ġ w", "o r", "Ġw or"]
TEXTS = ["cafe\u0301 and café", "12345 then 678", "the world, theory", "x=2024; y = 3.14159",
         "Hello, world!\n\n  indented\ttabs", "naïve Straße 東京 😀👍🏽", "<|im_start|>user\nhi<|im_end|>\n",
         "don't STOP'S 'll", ""]


def _vocab() -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    merged = [a + b for a, b in (m.split(" ") for m in MERGES)]
    return alphabet + merged + SPECIALS


def _byte_of(char: str) -> int:
    """GPT-2's byte -> printable character table, inverted: printable bytes map to themselves, the
    others, in byte order, to 256, 257, ..."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    code = ord(char)
    return code if code < 256 else others[code - 256]


def write_tokenizer_gguf(path, pre: str):
    from gguf import GGUFWriter

    tokens = _vocab()
    writer = GGUFWriter(str(path), "qwen2")
    for key, value in {"qwen2.block_count": 1, "qwen2.context_length": 64, "qwen2.embedding_length": 8,
                       "qwen2.feed_forward_length": 8, "qwen2.attention.head_count": 1,
                       "qwen2.attention.head_count_kv": 1}.items():
        writer.add_uint32(key, value)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [1] * (len(tokens) - 3) + [3, 3, 3])
    writer.add_array("tokenizer.ggml.merges", MERGES)
    writer.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
    writer.add_uint32("tokenizer.ggml.padding_token_id", tokens.index("<|endoftext|>"))
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 8), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


def ours(path):
    meta = GgufMetadata(open_gguf(path), path)
    config = LlamaConfig(vocab_size=len(_vocab()), hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    return build_tokenizer(meta, config)


@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "qwen2.gguf", "qwen2")
    return ours(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_qwen2_ids_equal_transformers(qwen2_pair, text):
    tokenizer, hf = qwen2_pair
    nfc = unicodedata.normalize("NFC", text)
    assert tokenizer.encode(text) == hf(nfc)["input_ids"]
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == nfc


def test_qwen2_isolates_digits_and_composes_accents(qwen2_pair):
    """The two ways the qwen2 rule differs from llama3's: single digits, NFC before BPE."""
    tokenizer, _ = qwen2_pair
    vocab = _vocab()
    assert [vocab[i] for i in tokenizer.encode("123")] == ["1", "2", "3"]
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("café")
    assert vocab.index("Ã©") in tokenizer.encode("cafe\u0301")


def test_llama3_rule_differs_on_the_same_file(tmp_path):
    """Sanity check of the test above: the llama-bpe rule merges "123" and leaves e + U+0301 apart."""
    tokenizer = ours(write_tokenizer_gguf(tmp_path / "llama3.gguf", "llama-bpe"))
    vocab = _vocab()
    assert [vocab[i] for i in tokenizer.encode("123")] == ["123"]
    assert tokenizer.encode("cafe\u0301") != tokenizer.encode("café")
