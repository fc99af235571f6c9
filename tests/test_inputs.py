"""entrypoints.inputs: vLLM's prompt dicts, and every key we do not act on refused by name."""
from __future__ import annotations

import pytest

from offline_paged.entrypoints.inputs import TextPrompt, TokensPrompt, prompt_fields


def test_text_and_token_prompts_give_their_fields():
    assert prompt_fields(TextPrompt(prompt="hi")) == ("hi", None)
    assert prompt_fields(TokensPrompt(prompt_token_ids=(5, 6))) == (None, [5, 6])
    assert prompt_fields({"prompt": "hi", "prompt_token_ids": [7]}) == ("hi", [7])  # the ids win; text kept


def test_unsupported_keys_are_refused_by_name():
    with pytest.raises(ValueError, match=r"prompt field\(s\) cache_salt, multi_modal_data not supported"):
        prompt_fields({"prompt": "x", "multi_modal_data": {}, "cache_salt": "s"})


def test_a_prompt_dict_needs_text_or_ids():
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        prompt_fields({})
