"""scripts/mask_pin_bench.py, the session 51 affinity experiment for the JSON bench: pin keeps the mask workers
off the step loop's CPU (read back from the kernel), free leaves placement alone; both run the whole bench."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = ["bench", "--device", "cpu", "--dummy-weights", "tiny", "--num-requests", "4", "--input-len", "8:16",
         "--output-len", "4:8", "--structured", "json", "--grammar-mask-processes", "1", "--async-scheduling",
         "--json"]


def run(mode: str, *knobs: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "mask_pin_bench.py"), mode, *knobs, *BENCH],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs two CPUs")
def test_pin_puts_the_workers_off_the_step_loops_cpu_and_the_bench_completes():
    done = run("pin")
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if line.startswith("mask_pin_bench.py:"))
    loop = json.loads(line.split("step loop on CPUs ")[1].split("]")[0] + "]")
    workers = json.loads(line.split("workers on CPUs ")[1])
    assert len(loop) == 1 and workers and loop[0] not in workers
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["label"] for r in record["runs"]] == ["paged", "paged json", "paged plain@json lengths"]


def test_free_leaves_placement_alone_and_knobs_are_set_first():
    done = run("free", "offline_paged.benchmark.bench.RECORD_HOST_LOAD=False")  # (on by default)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mask_pin_bench.py:" not in done.stderr
    runs = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    assert len(runs) == 3 and all(run["host_load"] is None for run in runs)


def test_a_mode_it_does_not_know_is_refused():
    done = run("pinned")
    assert done.returncode != 0 and "usage: mask_pin_bench.py pin|free" in done.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs two CPUs")
def test_pin_avoid_keeps_the_workers_off_the_named_cpus_and_refuses_to_leave_them_none():
    cpus = sorted(os.sched_getaffinity(0))
    done = run("pin", PIN_AVOID=",".join(map(str, cpus)))
    assert done.returncode != 0 and "leaves the workers no CPU" in done.stderr
    if len(cpus) >= 3:
        done = run("pin", PIN_AVOID=str(cpus[1]))
        assert done.returncode == 0, done.stderr[-2000:]
        line = next(line for line in done.stderr.splitlines() if line.startswith("mask_pin_bench.py:"))
        assert json.loads(line.split("workers on CPUs ")[1]) == cpus[2:]
