"""job_output: the OpenAI shapes' token strings (raw bytes, text offsets) on made-up tokens."""
from offline_paged.job.job_output import TokenStrings, _chat_token, _text_offsets

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


def test_openai_batch_records_validate_against_the_openai_types(tmp_path):
    """Real records from the CLI on a tiny model: every body parses as openai's own ChatCompletion /
    Completion, logprobs included; error lines carry the batch envelope with a 4xx status."""
    import json

    from click.testing import CliRunner
    from fixtures_tiny_model import write_tiny_model
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from offline_paged.cli.main import cli

    model = write_tiny_model(tmp_path / "model", max_position_embeddings=64)
    messages = [{"role": "user", "content": "Hi é😀"}]

    def line(custom_id, url, **body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}

    lines = [line("chat-lp", "/v1/chat/completions", messages=messages, max_tokens=4, logprobs=True, top_logprobs=2),
             line("chat", "/v1/chat/completions", messages=messages, max_tokens=3, n=2, seed=1),
             line("cmpl-lp", "/v1/completions", prompt="ab😀", max_tokens=3, logprobs=2),
             line("cmpl-echo", "/v1/completions", prompt="ab😀", max_tokens=0, echo=True, logprobs=1),
             line("bad", "/v1/completions", prompt="x", tools=[{"type": "function"}])]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli, ["generate", str(source), "-o", str(out), "-m", str(model), "--device", "cpu",
                                      "--block-size", "4", "--num-kv-blocks", "64", "--no-progress",
                                      "--served-model-name", "served", "--dtype", "float"])
    assert result.exit_code == 1, result.output  # the one bad line
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {x["custom_id"] for x in lines}
    for custom_id, record in records.items():
        assert set(record) >= {"id", "custom_id", "response", "error"}
        response = record["response"]
        if custom_id == "bad":
            assert 400 <= response["status_code"] < 500 and "not supported" in response["body"]["error"]["message"]
            continue
        assert response["status_code"] == 200 and record["error"] is None
        kind = ChatCompletion if custom_id.startswith("chat") else Completion
        body = kind.model_validate(_sdk_shape(response["body"]))
        assert body.model == "served" and body.usage is not None  # the model that ran, never the body's "m"
    chat = ChatCompletion.model_validate(records["chat-lp"]["response"]["body"])
    for token in chat.choices[0].logprobs.content:
        assert len(token.top_logprobs) == 2 and token.bytes is not None
    completion = Completion.model_validate(_sdk_shape(records["cmpl-echo"]["response"]["body"]))
    offsets, text = completion.choices[0].logprobs.text_offset, completion.choices[0].text
    assert text == "ab😀" and offsets == sorted(offsets) and offsets[-1] <= len(text)


def _sdk_shape(body: dict) -> dict:
    """The body as the SDK types accept it. With echo, the API itself (and vLLM, and lm-eval's reader)
    gives the first prompt token null log-probabilities, which the SDK's float lists do not allow:
    check that it is so, then stand 0.0 / {} in for it. Nothing else is changed."""
    import copy

    body = copy.deepcopy(body)
    for choice in body.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        if "token_logprobs" in logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            assert logprobs["top_logprobs"][0] is None
            assert all(v is not None for v in logprobs["token_logprobs"][1:])
            logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    return body
