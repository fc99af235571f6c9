"""Models by Hugging Face hub id ("ORG/NAME"), as vLLM and lm-eval's `pretrained=` name them.

`resolve_model(name, revision)` leaves a local path, a .gguf path and the default model alone; a
name that looks like a hub id and is not a local path is looked up in the standard Hugging Face
cache first (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub; `refs/<revision>`
or a commit hash), which works offline, and downloaded with huggingface_hub otherwise (only the
safetensors weights, JSON configs / tokenizer files and chat templates; never pickles). With
`HF_HUB_OFFLINE=1` nothing is downloaded. The error when neither works names both places it looked.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub uses, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub id rather than a local path (and names no existing path)."""
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf") and not Path(name).expanduser().exists()


def resolve_model(name: str | Path | None, revision: str | None = None) -> str | Path | None:
    """A local directory for a hub id; anything else is returned unchanged (the loader reports a
    missing path). Raises FileNotFoundError naming the local path and the cache when a hub id is in
    neither and cannot be downloaded."""
    if name is None or str(name) == "default" or not is_hub_id(str(name)):
        if revision is not None and name is not None and str(name) != "default":
            raise ValueError(f"revision={revision!r} applies to hub ids only, not to the local path {name}")
        return name
    return snapshot(str(name), revision)


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default main): cached, else downloaded."""
    from huggingface_hub import snapshot_download

    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - any cache miss falls through to the download
        cache_problem = _reason(exc)
    where = (f"{repo_id}: no such model: not a local path ({Path(repo_id).resolve()}) and not in the Hugging "
             f"Face cache ({cache}{'' if revision is None else f', revision {revision}'}: {cache_problem})")
    if _offline():
        raise FileNotFoundError(f"{where}; HF_HUB_OFFLINE is set, so nothing was downloaded. Download it on a "
                                f"machine with network access (huggingface-cli download {repo_id}) into that cache, "
                                "or pass a local HF directory") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - network, auth, missing repo: all end in one clear message
        raise FileNotFoundError(f"{where}; downloading it failed: {_reason(exc)}") from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
