"""benchmarks/bench_host_step.py, the CPU stand-in for the GPU path's host work, still runs the engine it
stubs: plain and JSON-constrained, eager and through its host-only decode graphs (a stale stand-in once
broke it silently)."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_host_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("structured", [None, "json"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_host_step_bench_runs_a_small_workload(bench, structured, graphs):
    args = argparse.Namespace(num_requests=12, output_len=6, graphs=graphs, profile=False, sync=False, repeat=1,
                              clock="wall", structured=structured, mask_processes=0)
    num_steps, totals = bench.run_once(args)
    assert num_steps >= 6 and totals["whole step"] > 0 and totals["postprocess"] > 0
    if structured:  # every constrained token was drawn from a mask, and the draw is kept out of the engine's time
        assert totals["stub token draw"] > 0
        assert totals["engine step"] == pytest.approx(totals["whole step"] - totals["stub token draw"])
        assert totals["feed matchers ahead"] > 0 and totals["mask dispatch"] > 0
