"""The bench text report and KV plot (benchmark/bench_report.py) on synthetic BenchResults with random
step records: ratios against the first run, the per-step split adding up, device and roofline lines
only when measured. test_bench.py formats the report of real CPU runs."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from offline_paged.benchmark.bench import BenchResult, Ceilings, StepRecord
from offline_paged.benchmark.bench_report import format_details, format_report, plot_kv


def _steps(rng, n: int, device: bool) -> list[StepRecord]:
    steps, end = [], 0.0
    for _ in range(n):
        parts = rng.uniform(1e-4, 3e-3, size=3)  # schedule, execute, postprocess
        wall = float(parts.sum() + rng.uniform(1e-5, 1e-3))
        end += wall
        steps.append(StepRecord(end_s=end, wall_s=wall, schedule_s=float(parts[0]), execute_s=float(parts[1]),
                                postprocess_s=float(parts[2]),
                                forward_s=float(parts[1] * 0.8) if device else None, cuda_graph=device,
                                num_seqs=int(rng.integers(1, 9)), num_tokens=int(rng.integers(1, 64)),
                                blocks_held=int(rng.integers(1, 40)), blocks_filled=float(rng.uniform(0.5, 1)),
                                floor_s=float(parts[1] * 0.5) if device else None))
    return steps


def _result(label: str, seed: int, device: bool = False, num_output_tokens: int = 900) -> BenchResult:
    rng = np.random.default_rng(seed)
    steps = _steps(rng, 12, device)
    return BenchResult(label=label, kv_layout="paged", block_size=16, num_requests=8, num_prompt_tokens=1234,
                       num_output_tokens=num_output_tokens, wall_s=sum(s.wall_s for s in steps) * 1.1,
                       num_gpu_blocks=64, max_model_len=512, num_preemptions=int(rng.integers(0, 4)),
                       peak_device_memory=(3 << 30) if device else None,
                       ceilings=Ceilings(bandwidth=4.1e12, matmul_flops=7.5e14, how="measured") if device else None,
                       steps=steps)


def test_table_rows_give_each_runs_ratio_to_the_first():
    a, b = _result("paged", 1), _result("contiguous", 2, num_output_tokens=450)
    lines = format_report([a, b], header="the header").splitlines()
    assert lines[0] == "the header" and lines[1].split()[-2:] == ["vs", "paged"]
    assert lines[2].startswith("paged") and lines[2].endswith("1.00x")
    want = b.output_tokens_per_s / a.output_tokens_per_s
    assert lines[3].startswith("contiguous") and lines[3].endswith(f"{want:.2f}x")
    assert f"{a.max_concurrent_seqs:>10}" in lines[2]
    assert sum(line.startswith("== ") for line in lines) == 2


def test_cpu_details_split_adds_up_and_say_no_device():
    r = _result("cpu", 3)
    details = format_details(r)
    assert "peak device memory n/a (CPU)" in details[2]
    split = r.time_split()
    rest = split["step_ms"] - split["schedule_ms"] - split["execute_ms"] - split["postprocess_ms"]
    assert details[4].startswith("per step (12 steps, 0 from CUDA graphs):")
    assert details[4].endswith(f"+ rest {rest:.2f}") and "forward on the device" not in details[4]
    assert not any(line.startswith("roofline") for line in details)


def test_device_details_show_forward_memory_and_roofline():
    r = _result("gpu", 4, device=True)
    details = format_details(r)
    assert "peak device memory 3.00 GiB" in details[2]
    assert "12 from CUDA graphs" in details[4]
    assert f"forward on the device {r.time_split()['forward_device_ms']:.2f} ms" in details[4]
    roof = r.roofline()
    assert details[-1].startswith(f"roofline: floor {roof['floor_s']:.2f} s")
    assert f"{roof['fraction_of_floor']:.1%} of the floor" in details[-1] and "(measured)" in details[-1]


def test_runs_without_step_records_say_so():
    r = _result("workers", 5)
    r.steps = []
    assert format_details(r)[4] == "per step: not recorded (the steps ran in worker processes)"


def test_plot_without_matplotlib_is_a_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
        plot_kv([_result("a", 6)], str(tmp_path / "kv.png"))


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "kv.png"
    plot_kv([_result("a", 7), _result("b", 8)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graph_steps_that_prefill_are_counted_apart():
    """A graph step with more tokens than sequences prefilled (mixed-step graphs); a decode graph step has one
    token per sequence; eager steps count in neither."""
    r = _result("cuda", 4, device=True)
    kinds = [(True, 5, 5), (True, 3, 40), (False, 2, 30), (True, 7, 7), (True, 1, 16)]  # (graph, seqs, tokens)
    for step, (graph, seqs, tokens) in zip(r.steps, kinds):
        step.cuda_graph, step.num_seqs, step.num_tokens = graph, seqs, tokens
    r.steps = r.steps[:len(kinds)]
    split = r.time_split()
    assert split["num_cuda_graph_steps"] == 4 and split["num_prefill_graph_steps"] == 2
    assert format_details(r)[4].startswith("per step (5 steps, 4 from CUDA graphs, 2 of them prefilling):")
    kinds = r.step_kinds()
    assert {kind: k["num_steps"] for kind, k in kinds.items()} == {"decode graph": 2, "prefill graph": 2, "eager": 1}
    prefill = [s for s in r.steps if s.cuda_graph and s.num_tokens > s.num_seqs]
    assert kinds["prefill graph"]["tokens"] == 28
    wall, forward = np.mean([s.wall_s for s in prefill]), np.mean([s.forward_s for s in prefill])
    assert kinds["prefill graph"]["host_only_share"] == pytest.approx(1 - forward / wall)
    assert kinds["prefill graph"]["execute_ms"] == pytest.approx(1e3 * np.mean([s.execute_s for s in prefill]))
    assert any(line.startswith("steps by kind: decode graph 2 (") and "prefill graph 2 (28 tokens" in line
               for line in format_details(r))


def test_step_kinds_on_the_cpu_have_no_forward_and_print_no_line():
    r = _result("cpu", 5)
    assert set(r.step_kinds()) == {"eager"} and r.step_kinds()["eager"]["host_only_share"] is None
    assert not any(line.startswith("steps by kind") for line in format_details(r))
