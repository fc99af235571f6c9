"""Tokenizer wrapper on the default model's tokenizer: round trips, EOS, token bytes (streaming: test_detokenizer.py)."""
import pytest

from offline_paged.models.default_model import ensure_default_model
from offline_paged.models.tokenizer import Tokenizer

STREAM_TEXTS = ["emoji 😀👍🏽🇫🇷 done", "東京タワー and Ελληνικά", "plain ascii, code: x[i] += 1\n"]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(ensure_default_model())


def test_special_ids_and_chat_encoding(tokenizer):
    assert tokenizer.eos_token_ids == frozenset({2}) and tokenizer.bos_token_id == 1
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[-4:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids.count(1) == 3  # system, user, assistant turns each open with <|im_start|>


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_token_bytes_are_the_vocabularys_raw_bytes(tokenizer, text):
    """Joined, they are the text's UTF-8; a token holding part of a character gives that part."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    if any(ord(ch) > 0xFFFF for ch in text):
        assert any(p and p != p.decode("utf-8", errors="replace").encode() for p in pieces), \
            "expected a token holding part of a 4-byte character"
    assert b"\xef\xbf\xbd" not in b"".join(pieces)  # never the bytes of U+FFFD


def test_token_bytes_of_a_special_token_is_its_text(tokenizer):
    assert tokenizer.token_bytes(2) == b"<|im_end|>"
