"""`offline-paged bench` end to end on the GPU, with decode CUDA graphs on and off (needs a GPU).

The bench once crashed only with graphs on: its probe recorded CUDA events inside the forward that the
graph runner captures. The step now reports its own timings (StepReport), and these runs are what
would have shown the crash.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from click.testing import CliRunner  # noqa: E402

from offline_paged.cli.main import cli  # noqa: E402

ARGS = ["bench", "--dummy-weights", "smollm2-135m", "--device", "cuda", "--num-requests", "12",
        "--input-len", "8:48", "--output-len", "4:24", "--json", "--no-roofline"]


def _bench(*extra: str) -> dict:
    result = CliRunner().invoke(cli, [*ARGS, *extra])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("graphs", [True, False])
def test_bench_runs_with_and_without_cuda_graphs(graphs):
    from offline_paged.benchmark.bench import random_workload

    report = _bench("--cuda-graphs" if graphs else "--no-cuda-graphs")
    (run,) = report["runs"]
    expected = sum(r.params.max_tokens for r in random_workload(12, (8, 48), (4, 24), 49152, 0))
    assert run["num_output_tokens"] == expected
    split = run["time_split"]
    assert split["forward_device_ms"] > 0
    # the device's idle time between forwards lies inside the steps' wall time
    assert 0 <= split["device_idle_ms"] < split["step_ms"]
    assert (split["num_cuda_graph_steps"] > 0) == graphs
    assert report["device"] and "git_commit" in report


def test_bench_steps_report_the_device_idle_before_each_forward():
    (run,) = _bench("--cuda-graphs", "--json-steps")["runs"]
    steps = run["steps"]
    assert steps[0]["idle_before_s"] is None  # no forward before the first
    idle = [s["idle_before_s"] for s in steps[1:] if s["forward_s"]]
    assert idle and all(0 <= x < 1 for x in idle)
    assert sum(idle) / len(steps) * 1e3 == pytest.approx(run["time_split"]["device_idle_ms"])


@pytest.mark.parametrize("graphs", [True, False])
def test_bench_measures_float16_and_bfloat16_in_one_call(graphs):
    report = _bench("--dtype", "float16", "--dtype", "bfloat16", "--cuda-graphs" if graphs else "--no-cuda-graphs")
    assert "cuda float16/bfloat16" in report["header"]
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["paged float16", "paged bfloat16"]
    assert runs[0]["num_output_tokens"] == runs[1]["num_output_tokens"] > 0
    assert all((r["time_split"]["num_cuda_graph_steps"] > 0) == graphs for r in runs)
