"""IncrementalDetokenizer on the default model's tokenizer: never half a character, pieces add up."""
import pytest

from offline_paged.models.default_model import ensure_default_model
from offline_paged.models.detokenizer import IncrementalDetokenizer
from offline_paged.models.tokenizer import Tokenizer

from test_tokenizer import STREAM_TEXTS


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(ensure_default_model())


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_never_emits_half_characters_and_adds_up(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-token words: the stream is really incremental
    stream = IncrementalDetokenizer(tokenizer)
    pieces = [stream.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == stream.text == tokenizer.decode(ids) == text


def test_streaming_holds_back_a_split_emoji(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    stream = IncrementalDetokenizer(tokenizer)
    assert [stream.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) == "😀"


def test_streaming_skips_special_tokens(tokenizer):
    stream = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("hi") + [2]
    assert "".join(stream.push([i]) for i in ids) == "hi"
