"""Shared test set-up: Hypothesis profiles and the `gpu` marker.

OFFLINE_PAGED_HYPOTHESIS_PROFILE=ci (default) keeps `make test` bounded; =fuzz runs the long fuzz.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.register_profile(
    "fuzz", deadline=None, suppress_health_check=list(HealthCheck), max_examples=5000
)
settings.load_profile(os.environ.get("OFFLINE_PAGED_HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (CuPy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
