"""The public paths offline_paged.lm_eval and offline_paged.ray hand out the implementations, and
`import offline_paged` pulls in neither lm-eval nor Ray (both optional extras)."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(statement: str) -> set[str]:
    """Top-level module names imported by `statement` in a fresh interpreter."""
    code = f"{statement}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_importing_the_package_imports_neither_lm_eval_nor_ray():
    loaded = _modules_after("import offline_paged")
    assert "offline_paged" in loaded and not {"lm_eval", "ray"} & loaded


def test_the_ray_path_is_the_jobs_processor_and_imports_no_ray():
    import offline_paged.ray
    from offline_paged.job.ray import Processor

    assert offline_paged.ray.Processor is Processor and offline_paged.ray.__all__ == ["Processor"]
    assert "ray" not in _modules_after("from offline_paged.ray import Processor")


def test_the_lm_eval_path_is_the_registered_backend():
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    import offline_paged.lm_eval
    from offline_paged.entrypoints.lm_eval import OfflinePagedLM

    assert offline_paged.lm_eval.OfflinePagedLM is OfflinePagedLM
    assert get_model("offline-paged") is OfflinePagedLM
