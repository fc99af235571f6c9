"""`offline-paged bench --structured json`: the plain and the constrained run in one call, the second
reported against the first; the structured workload is the same requests with a schema each."""
import json

import pytest
from click.testing import CliRunner

from offline_paged.benchmark.bench import BENCH_SCHEMA, random_workload, structured_workload
from offline_paged.cli.main import cli


def test_structured_workload_constrains_every_request_and_keeps_the_rest():
    plain = random_workload(5, (4, 8), (3, 6), 100)
    constrained = structured_workload(plain)
    assert [r.prompt_token_ids for r in constrained] == [r.prompt_token_ids for r in plain]
    assert all(r.params.structured_outputs.schema == BENCH_SCHEMA for r in constrained)
    assert [r.params.max_tokens for r in constrained] == [r.params.max_tokens for r in plain]
    with pytest.raises(ValueError, match="unknown structured workload"):
        structured_workload(plain, "xml")


def test_cli_runs_plain_then_json_and_reports_both():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "6",
                                      "--input-len", "8", "--output-len", "24", "--no-roofline", "--json",
                                      "--structured", "json"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout.splitlines()[-1])["runs"]
    assert [r["label"] for r in runs] == ["paged", "paged json"]
    assert runs[0]["num_output_tokens"] == 6 * 24
    assert 6 <= runs[1]["num_output_tokens"] <= 6 * 24  # a completed grammar may end a request early


def test_cli_refuses_structured_with_data_parallel():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--structured", "json",
                                      "--data-parallel-size", "2"])
    assert result.exit_code == 2 and "--structured" in result.output
