"""Chat templates render HF-style in jinja2's immutable sandbox (its bounds: test_template_sandbox.py)."""
import pytest

from offline_paged.models.chat_template import ChatTemplate, ChatTemplateError
from tiny_llama import CHATML


def test_renders_chatml_with_generation_prompt():
    out = ChatTemplate(CHATML).render([{"role": "user", "content": "hé 😀"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhé 😀<|im_end|>\n<|im_start|>assistant\n"
    assert not ChatTemplate(CHATML).render([{"role": "user", "content": "x"}], False).endswith("assistant\n")


def test_sandbox_blocks_python_internals():
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        evil.render([{"role": "user", "content": "x"}])


def test_sandbox_is_immutable():
    mutate = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}ok")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        mutate.render([{"role": "user", "content": "x"}])


def test_raise_exception_and_special_tokens():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                     "{{ bos_token }}{{ messages[0]['content'] | tojson }}")
    assert t.render([{"role": "user", "content": "é"}], bos_token="<s>") == '<s>"é"'
    with pytest.raises(ChatTemplateError, match="user first"):
        t.render([{"role": "system", "content": "x"}])


def test_bad_template_and_bad_messages():
    with pytest.raises(ChatTemplateError, match="invalid Jinja"):
        ChatTemplate("{% for %}")
    with pytest.raises(ValueError, match="non-empty list"):
        ChatTemplate(CHATML).render([])


# hostile templates, loop controls and {% generation %}: test_template_sandbox.py
USER = [{"role": "user", "content": "x"}]
def test_template_that_is_not_a_string_is_a_load_error():
    with pytest.raises(ChatTemplateError, match=r"cfg\.json: the chat template must be a string, got dict"):
        ChatTemplate({"not": "a template"}, origin="cfg.json")


def test_tokenizer_passes_template_kwargs(tmp_path):
    from offline_paged.models.tokenizer import Tokenizer
    from tiny_llama import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 16)
    tok = Tokenizer.from_dir(tmp_path)
    tok.chat_template = ChatTemplate("{{ messages[0]['content'] }}{% if flag %} w3{% endif %}")
    assert tok.apply_chat_template(USER, chat_template_kwargs={"flag": True}) == "x w3"
    assert tok.encode_chat([{"role": "user", "content": "w1"}], True, {"flag": True}) == [4, 6]
    with pytest.raises(ValueError, match="chat_template_kwargs may not set messages"):
        tok.apply_chat_template(USER, chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="keys are identifiers"):
        tok.apply_chat_template(USER, chat_template_kwargs=["flag"])


@pytest.mark.parametrize("value,message", [(12, "must be a string, got int"),
                                           ([1, 2], "entries are not")])
def test_tokenizer_config_template_of_wrong_type_is_a_load_error(tmp_path, value, message):
    import json

    from offline_paged.models.tokenizer import Tokenizer
    from tiny_llama import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 16)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": value}))
    with pytest.raises(ValueError, match=rf"tokenizer_config\.json.*{message}"):
        Tokenizer.from_dir(tmp_path)
