"""Shared test set-up: Hypothesis profiles and the `gpu` marker.

OFFLINE_PAGED_HYPOTHESIS_PROFILE=ci (default) keeps `make test` bounded; =fuzz runs the long fuzz.
The ci profile gives each stateful test 100 runs of 500 rule steps, so the allocator and block
manager state machines together take >= 100k rule steps per run (the terminal summary prints the
count); fuzz gives 5000 runs of 1000 steps each (hours on a small machine).
"""
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    # Long stateful runs are large by design; that is not a generation problem here.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
    derandomize=False,
    max_examples=100,
    stateful_step_count=500,
)
settings.register_profile(
    "fuzz",
    deadline=None,
    suppress_health_check=list(HealthCheck),
    max_examples=5000,
    stateful_step_count=1000,
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


def pytest_terminal_summary(terminalreporter):
    """Report how many rule steps the state machines ran (they count them in `num_steps`)."""
    from hypothesis.stateful import RuleBasedStateMachine

    counts = {}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").rpartition(".")[2].startswith("test_"):
            continue
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, RuleBasedStateMachine)
                    and getattr(value, "num_steps", 0)):
                counts[value.__name__] = value.num_steps
    if counts:
        listed = ", ".join(f"{name} {steps}" for name, steps in sorted(counts.items()))
        terminalreporter.write_line(
            f"state machine rule steps: {listed}; total {sum(counts.values())}"
        )
