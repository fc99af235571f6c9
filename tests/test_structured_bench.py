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
                                      "--input-len", "8", "--output-len", "200", "--no-roofline", "--json",
                                      "--structured", "json"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout.splitlines()[-1])["runs"]
    assert [r["label"] for r in runs] == ["paged", "paged json", "paged plain@json lengths"]
    assert runs[0]["num_output_tokens"] == 6 * 200
    assert 6 <= runs[1]["num_output_tokens"] < 6 * 200  # completed grammars ended requests early
    # The like-for-like run: unconstrained, each request to its constrained output's length.
    assert runs[2]["num_output_tokens"] == runs[1]["num_output_tokens"] and runs[2]["mask_server"] is None


def test_at_lengths_keeps_the_prompts_and_drops_the_constraint():
    from offline_paged.benchmark.bench import at_lengths

    constrained = structured_workload(random_workload(3, (4, 8), (10, 20), 100))
    plain = at_lengths(constrained, [5, 0, 12])
    assert [r.prompt_token_ids for r in plain] == [r.prompt_token_ids for r in constrained]
    assert [(r.params.max_tokens, r.params.min_tokens) for r in plain] == [(5, 5), (1, 1), (12, 12)]
    assert all(r.params.structured_outputs is None and r.params.ignore_eos for r in plain)
    with pytest.raises(ValueError, match="2 lengths for 3 requests"):
        at_lengths(constrained, [1, 2])


def test_each_grammar_mask_processes_value_is_a_structured_run_with_its_counters():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "6",
                                      "--input-len", "8", "--output-len", "24", "--no-roofline", "--json",
                                      "--structured", "json", "--async-scheduling",
                                      "--grammar-mask-processes", "0", "--grammar-mask-processes", "2"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout.splitlines()[-1])["runs"]
    assert [r["label"] for r in runs] == ["paged", "paged json m=0", "paged json m=2", "paged plain@json lengths"]
    assert runs[0]["mask_server"] is None and runs[1]["mask_server"] is None
    served = runs[2]["mask_server"]
    assert served["num_workers"] == 2 and served["num_fills"] > 0 and served["num_outcomes"] > 0
    assert served["outcome_wait_ms"] >= 0 and served["mask_wait_ms"] >= 0
    # The post phase's parts: only the constrained runs feed matchers and start mask fills.
    assert runs[0]["time_split"]["mask_dispatch_ms"] == 0 < runs[2]["time_split"]["mask_dispatch_ms"]
    for run in runs:
        split = run["time_split"]
        assert 0 <= split["token_wait_ms"] + split["mask_dispatch_ms"] <= split["postprocess_ms"]


def test_cli_refuses_structured_with_data_parallel():
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--structured", "json",
                                      "--data-parallel-size", "2"])
    assert result.exit_code == 2 and "--structured" in result.output


def test_repeat_interleaves_the_runs_and_reports_medians():
    """--repeat 3 with --structured json: plain #1, json #1, plain #2, ... and a medians table whose figures are
    the medians of each configuration's runs."""
    args = ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--num-requests", "4", "--input-len", "8",
            "--output-len", "12", "--no-roofline", "--structured", "json", "--repeat", "3"]
    runs = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout.splitlines()[-1])["runs"]
    assert [r["label"] for r in runs] == [f"paged{variant} #{k}" for k in (1, 2, 3)
                                          for variant in ("", " json", " plain@json lengths")]
    for k in range(3):  # each repeat's like-for-like run takes that repeat's constrained lengths
        assert runs[3 * k + 2]["num_output_tokens"] == runs[3 * k + 1]["num_output_tokens"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("median of repeats"))) + 1:][:3]
    assert [line.split()[0] for line in table] == ["paged"] * 3
    assert table[1].split()[1] == "json" and table[2].split()[1] == "plain@json"
    assert table[0].split()[-1] == "1.00x"


def test_medians_table_takes_the_median_of_each_configuration():
    from offline_paged.benchmark.bench_report import format_medians

    class Run:
        def __init__(self, label, tok_s):
            self.label, self.output_tokens_per_s, self.steps = label, tok_s, []

    runs = [Run("a #1", 10.0), Run("b #1", 4.0), Run("a #2", 40.0), Run("b #2", 8.0), Run("a #3", 20.0),
            Run("b #3", 6.0)]
    rows = {line.split()[0]: line.split() for line in format_medians(runs)[2:]}
    assert rows["a"][1] == "20" and rows["b"][1] == "6" and rows["b"][-1] == "0.30x"
    assert format_medians([Run("a", 1.0), Run("b", 2.0)]) == []  # nothing repeated: no table


def test_like_for_like_ratios_pair_each_constrained_run_with_its_repeat_s_reference():
    from offline_paged.benchmark.bench_report import format_like_for_like

    class Run:
        def __init__(self, label, tok_s):
            self.label, self.output_tokens_per_s = label, tok_s

    runs = [Run("paged #1", 10.0), Run("paged json m=0 #1", 3.0), Run("paged json m=8 #1", 6.0),
            Run("paged plain@json lengths #1", 8.0), Run("paged #2", 10.0), Run("paged json m=0 #2", 2.0),
            Run("paged json m=8 #2", 7.0), Run("paged plain@json lengths #2", 7.0)]
    lines = format_like_for_like(runs)
    assert [line.split()[:4] for line in lines[2:6]] == [
        ["paged", "json", "m=0", "#1"], ["paged", "json", "m=8", "#1"], ["paged", "json", "m=0", "#2"],
        ["paged", "json", "m=8", "#2"]]
    assert [line.split()[4] for line in lines[2:6]] == ["0.38x", "0.75x", "0.29x", "1.00x"]
    assert lines[6].split()[:5] == ["paged", "json", "m=0", "(median)", "0.33x"]
    assert lines[7].split()[:5] == ["paged", "json", "m=8", "(median)", "0.88x"]
    assert format_like_for_like([Run("paged", 1.0), Run("paged json", 0.5)]) == []  # no reference run
    single = format_like_for_like([Run("paged", 9.0), Run("paged json", 3.0), Run("paged plain@json lengths", 6.0)])
    assert single[2].split()[:3] == ["paged", "json", "0.50x"] and len(single) == 3


def test_a_request_whose_grammar_fails_mid_generation_is_counted_not_a_crash():
    """run_bench gets a RequestError for it (its only allowed token is refused by its regex)."""
    from offline_paged.benchmark.bench import BenchRequest, run_bench
    from offline_paged.benchmark.bench_report import format_details
    from offline_paged.core.sampling_params import SamplingParams
    from offline_paged.core.structured_outputs import StructuredOutputsParams
    from tiny_engine import ByteTokenizer, tiny_engine

    z = ByteTokenizer().encode("z")[0]
    doomed = SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[z],
                            structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    requests = [BenchRequest([5, 6, 7], SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True)),
                BenchRequest([5, 6, 8], doomed)]
    result = run_bench(tiny_engine(), requests)
    assert result.num_output_tokens == 6 and result.output_lengths == [6, 0]
    assert len(result.errors) == 1 and result.errors[0].startswith("bench-1: structured output failed")
    assert json.loads(result.to_json())["num_errors"] == 1
    assert any(line.startswith("1 request(s) ended with an error") for line in format_details(result))


def test_a_file_line_whose_grammar_does_not_compile_is_a_usage_error_naming_it(tmp_path):
    path = tmp_path / "job.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 4}) + "\n\n"
                    + json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 4, "structured_outputs": {"regex": "(("}})
                    + "\n")
    result = CliRunner().invoke(cli, ["bench", "--dummy-weights", "tiny", "--device", "cpu", "--workload", "file",
                                      "--input-file", str(path), "--no-roofline"])
    assert result.exit_code == 2, result.output
    assert f"--input-file {path}: line 3: invalid structured_outputs regex" in result.output
