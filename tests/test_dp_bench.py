"""`offline-paged bench --data-parallel-size N` on the CPU with the tiny dummy preset: the workload
runs through N worker processes (and one, with --compare-single) and every token is counted."""
import json

import pytest
from click.testing import CliRunner

from offline_paged.benchmark.bench import random_workload
from offline_paged.cli.main import cli
from offline_paged.models.dummy_weights import PRESETS

WORKLOAD = ["--num-requests", "6", "--input-len", "4:12", "--output-len", "2:6", "--seed", "3"]


def test_data_parallel_bench_reports_one_engine_and_n_engines_on_the_same_workload():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", *WORKLOAD,
                                      "--max-num-seqs", "2", "--data-parallel-size", "2",
                                      "--compare-single", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert "data parallel 2" in report["header"]
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["1 engine", "2 engines"]
    want = random_workload(6, (4, 12), (2, 6), PRESETS["tiny"].vocab_size, 3)
    for run in runs:  # ignore_eos with min_tokens = max_tokens: every drawn token is generated
        assert run["num_requests"] == 6
        assert run["num_output_tokens"] == sum(r.params.max_tokens for r in want)
        assert run["num_prompt_tokens"] == sum(len(r.prompt_token_ids) for r in want)
        assert run["output_tokens_per_s"] > 0
    assert runs[1]["num_gpu_blocks"] == 2 * runs[0]["num_gpu_blocks"]  # one KV pool per worker


@pytest.mark.parametrize("args, message", [
    (["--compare-single"], "needs --data-parallel-size"),
    (["--data-parallel-size", "0"], "0 is not in the range x>=1"),
    (["--data-parallel-size", "2", "--plot", "x.png"], "per-step series"),
])
def test_data_parallel_bench_option_errors(args, message):
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", *args])
    assert result.exit_code == 2
    assert message in result.output
