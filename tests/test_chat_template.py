"""Chat templates render HF-style in jinja2's immutable sandbox."""
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
