"""HFTokenizer (entrypoints/hf_tokenizer.py): answers like transformers' tokenizer on the same directory;
its fallbacks and refusals on a bare tokenizer."""
from __future__ import annotations

import pytest

from offline_paged.entrypoints.hf_tokenizer import HFTokenizer, render_chat

from test_llm import llm, model_dir  # noqa: F401 (fixtures)


def test_tokenizer_answers_like_transformers_on_the_same_directory(llm, model_dir):
    from transformers import AutoTokenizer

    ours, theirs = llm.get_tokenizer(), AutoTokenizer.from_pretrained(str(model_dir))
    text = "Hello wörld <|im_end|> 🪐"
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.chat_template == theirs.chat_template
    assert ours.encode(text) == theirs.encode(text)
    ids = theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "Hi"}]
    for add in (False, True):
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add) == \
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    assert ours.apply_chat_template(messages) == list(theirs.apply_chat_template(messages, return_dict=False))


class BareTokenizer:
    """Encode/decode and EOS ids only: no backend, no special-token names, no chat template."""

    vocab_size = 40
    eos_token_ids = frozenset({31, 7})
    bos_token_id = 3

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 40 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i in self.eos_token_ids))


def test_fallbacks_on_a_bare_tokenizer():
    tok = HFTokenizer(BareTokenizer())
    assert (tok.eos_token, tok.bos_token) == (None, None)
    assert (tok.eos_token_id, tok.bos_token_id) == (7, 3)  # the smallest EOS id
    assert len(tok) == 40 and tok.chat_template is None
    assert tok.decode(7) == "h" and tok.decode([7, 1], skip_special_tokens=True) == "b"  # keeps specials by default
    assert tok.batch_decode([[0, 1], [2]]) == ["ab", "c"]
    assert tok.convert_ids_to_tokens([0, 25]) == ["a", "z"] and tok.convert_tokens_to_ids("a") is None


def test_chat_refusals():
    tok = HFTokenizer(BareTokenizer())
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="continue_final_message is not supported"):
        tok.apply_chat_template(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="tools are not supported"):
        tok.apply_chat_template(messages, tools=[{}])
    with pytest.raises(ValueError, match="no chat template; pass chat_template="):
        render_chat(BareTokenizer(), messages, True, None, {"flag": 1})
    text = tok.apply_chat_template(messages, tokenize=False, chat_template="{{ messages[0]['content'] }}|{{ x }}", x=5)
    assert text == "hi|5"
    assert tok.apply_chat_template(messages, chat_template="{{ messages[0]['content'] }}") == [ord("h") % 40, ord("i") % 40]
