"""models/hub.py: a hub id resolves from a Hugging Face cache laid out as huggingface_hub lays it out,
offline included, at the asked revision; a miss names both places it looked; local paths pass through."""
from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_hf_cache import add_to_hf_cache
from fixtures_tiny_model import write_tiny_model

from offline_paged.models.hub import hf_cache_dir, is_hub_id, resolve_model
from offline_paged.models.loader import load_model, load_tokenizer


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-hub"), seed=3)


def test_a_hub_id_loads_from_the_cache_offline(hf_cache, tiny_dir):
    snapshot = add_to_hf_cache(hf_cache, "TinyOrg/Tiny-LM", tiny_dir)
    assert resolve_model("TinyOrg/Tiny-LM") == snapshot
    loaded = load_model("TinyOrg/Tiny-LM")
    assert loaded.source == str(snapshot)
    assert loaded.config.vocab_size == load_model(tiny_dir).config.vocab_size
    assert load_tokenizer("TinyOrg/Tiny-LM")[1].encode("hi") == load_model(tiny_dir).tokenizer.encode("hi")


def test_revision_picks_the_snapshot_its_ref_names(hf_cache, tiny_dir):
    add_to_hf_cache(hf_cache, "TinyOrg/Tiny-LM", tiny_dir, commit="a" * 40)
    other = add_to_hf_cache(hf_cache, "TinyOrg/Tiny-LM", tiny_dir, commit="b" * 40, revision="v2")
    assert resolve_model("TinyOrg/Tiny-LM", revision="v2") == other
    assert resolve_model("TinyOrg/Tiny-LM", revision="b" * 40) == other
    assert resolve_model("TinyOrg/Tiny-LM") != other


def test_hf_home_gives_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    snapshot = add_to_hf_cache(tmp_path / "hf" / "hub", "Org/Model", tiny_dir)
    assert resolve_model("Org/Model") == snapshot


def test_a_missing_hub_id_names_the_local_path_and_the_cache(hf_cache):
    with pytest.raises(FileNotFoundError) as info:
        load_model("NoSuchOrg/no-such-model")
    message = str(info.value)
    assert str(Path("NoSuchOrg/no-such-model").resolve()) in message and str(hf_cache) in message
    assert "HF_HUB_OFFLINE" in message


def test_local_paths_and_default_pass_through(tmp_path, tiny_dir):
    assert resolve_model(str(tiny_dir)) == str(tiny_dir)
    assert resolve_model("default") == "default" and resolve_model(None) is None
    assert not is_hub_id(str(tiny_dir)) and not is_hub_id("model.gguf") and not is_hub_id("a/b/c")
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="revision"):
        resolve_model(str(tiny_dir), revision="main")


def test_generate_takes_a_hub_id_and_a_missing_one_is_one_error_line(hf_cache, tiny_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from offline_paged.cli.main import cli

    add_to_hf_cache(hf_cache, "TinyOrg/Tiny-LM", tiny_dir)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}}) + "\n")
    args = ["generate", str(source), "-o", str(out), "--device", "cpu", "--num-kv-blocks", "32", "--no-progress"]
    result = CliRunner().invoke(cli, [*args, "-m", "TinyOrg/Tiny-LM"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["response"]["body"]["model"] == "TinyOrg/Tiny-LM"
    missing = CliRunner().invoke(cli, [*args, "--no-resume", "-m", "TinyOrg/absent"])
    assert missing.exit_code == 2 and "Traceback" not in missing.output
    assert "not in the Hugging Face cache" in missing.output and str(hf_cache) in missing.output


def test_online_a_cache_miss_downloads_weights_and_configs_only(tmp_path, monkeypatch, tiny_dir):
    """Without HF_HUB_OFFLINE a miss goes to snapshot_download (faked here: no hub in tests) with
    patterns that take safetensors, JSON and templates, never pickles; its failure is named."""
    import fnmatch

    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, *, local_files_only=False, allow_patterns=None, **kwargs):
        calls.append((repo_id, local_files_only, allow_patterns, kwargs.get("revision")))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        if repo_id == "Org/unreachable":
            raise OSError("network is unreachable")
        return str(tiny_dir)

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("Org/Model", revision="v3") == tiny_dir
    assert [(c[0], c[1], c[3]) for c in calls] == [("Org/Model", True, "v3"), ("Org/Model", False, "v3")]
    patterns = calls[-1][2]
    wanted = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
              "tokenizer.json", "tokenizer_config.json", "generation_config.json", "1_Pooling/config.json",
              "chat_template.jinja"]
    assert all(any(fnmatch.fnmatch(name, p) for p in patterns) for name in wanted)
    assert not any(fnmatch.fnmatch(name, p) for p in patterns for name in ("pytorch_model.bin", "model.pt"))
    with pytest.raises(FileNotFoundError, match="downloading it failed: OSError: network is unreachable"):
        resolve_model("Org/unreachable")
