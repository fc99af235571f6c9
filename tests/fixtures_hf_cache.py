"""Test helper: put a model directory into a fake Hugging Face hub cache, laid out as huggingface_hub
lays it out (models--ORG--NAME/snapshots/<commit>/..., refs/<revision> holding the commit)."""
from __future__ import annotations

import shutil
from pathlib import Path


def add_to_hf_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = "a" * 40,
                    revision: str = "main") -> Path:
    """Copy `model_dir`'s files into `cache` as `repo_id` at `commit`, `refs/<revision>` pointing at it.
    Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
