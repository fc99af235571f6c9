"""job_output: the OpenAI shapes' token strings (raw bytes, text offsets) on made-up tokens."""
from offline_paged.job_output import TokenStrings, _chat_token, _text_offsets

# token id -> raw bytes: "a", the first half and second half of "é" (C3 A9), "😀" in two halves, "b"
RAW = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"\xf0\x9f", 5: b"\x98\x80", 6: b"b"}
TOKENS = TokenStrings(text=lambda t: RAW[t].decode("utf-8", errors="replace"), raw=RAW.__getitem__)


def test_chat_token_bytes_are_raw_not_the_replacement_character():
    entry = _chat_token(2, -0.5, TOKENS)
    assert entry == {"token": "\ufffd", "logprob": -0.5, "bytes": [0xC3]}


def test_text_offsets_follow_the_characters_each_token_completes():
    ids = [1, 2, 3, 4, 5, 6]
    text = b"".join(RAW[t] for t in ids).decode("utf-8")  # "aé😀b"
    offsets = _text_offsets(ids, TOKENS)
    assert offsets == [0, 1, 1, 2, 2, 3]
    assert text[offsets[-1]:] == "b" and len(text) == 4
    assert offsets == sorted(offsets)


def test_token_strings_fall_back_to_the_decoded_text_without_token_bytes():
    class Decoder:
        def decode(self, ids, skip_special_tokens=True):
            return {7: "ö"}[ids[0]]

    strings = TokenStrings.of(Decoder())
    assert strings.text(7) == "ö" and strings.raw(7) == "ö".encode()
