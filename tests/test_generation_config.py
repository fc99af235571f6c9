"""entrypoints.generation_config: a model's generation_config.json as sampling defaults, as vLLM reads it."""
from __future__ import annotations

import json

import pytest

from offline_paged.entrypoints.generation_config import sampling_defaults


def _model_dir(tmp_path, content):
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(tmp_path)


def test_auto_reads_the_sampling_keys_and_renames_max_new_tokens(tmp_path):
    model = _model_dir(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                  "repetition_penalty": 1.1, "max_new_tokens": 77, "do_sample": True,
                                  "eos_token_id": [1, 2], "top_a": None})
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                        "repetition_penalty": 1.1, "max_tokens": 77}


def test_null_values_are_skipped(tmp_path):
    assert sampling_defaults(_model_dir(tmp_path, {"temperature": None, "top_k": 5})) == {"top_k": 5}


def test_vllm_mode_a_missing_file_and_no_model_give_no_defaults(tmp_path):
    model = _model_dir(tmp_path, {"temperature": 0.1})
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(None) == {}
    assert sampling_defaults(str(tmp_path / "absent")) == {}


def test_an_explicit_directory_is_read_and_must_hold_the_file(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert sampling_defaults("/nonexistent/model", str(other)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match=r"generation_config: .*empty/generation_config.json not found"):
        sampling_defaults("/nonexistent/model", str(tmp_path / "empty"))


def test_broken_json_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config.json: not valid JSON"):
        sampling_defaults(_model_dir(tmp_path, "{nope"))
