"""benchmarks/bench_job_window.py runs a job through the JobRunner at each read-ahead window and counts every
output token the workload asks for, as the bench's run of the same workload does (the tiny preset on the CPU)."""
from __future__ import annotations

import json

from fixtures_scripts import load_script


def test_each_window_runs_the_whole_job(capsys):
    module = load_script("benchmarks/bench_job_window.py")
    module.main(["--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "24", "--input-len", "4:12",
                 "--output-len", "3:9", "--window", "4", "--window", "32", "--repeat", "1", "--with-bench"])
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [run["window"] for run in runs] == [4, 32, "bench"]  # the bench's way last: every request up front
    lines = [json.loads(line) for line in module.job_lines(module.random_workload(24, (4, 12), (3, 9), 512))]
    expected = sum(line["max_tokens"] for line in lines)
    assert all(run["output_tokens"] == expected and run["num_steps"] > 0 for run in runs)
    # 4 lines in the engine at a time take more steps; a window of 32 holds all 24, as the bench's way does
    assert runs[0]["num_steps"] > runs[1]["num_steps"] == runs[2]["num_steps"]
