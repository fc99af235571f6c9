"""benchmarks/bench_host_step.py, the CPU stand-in for the GPU path's host work, still runs the engine it
stubs: plain and JSON-constrained, eager and through its host-only decode graphs (a stale stand-in once
broke it silently)."""
from __future__ import annotations

import pytest
from fixtures_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_host_step.py")


@pytest.mark.parametrize("structured", [None, "json"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_host_step_bench_runs_a_small_workload(bench, structured, graphs):
    args = bench.parse_args(["--num-requests", "12", "--output-len", "6", *(["--graphs"] if graphs else []),
                             *(["--structured", structured] if structured else [])])
    num_steps, totals = bench.run_once(args)
    assert num_steps >= 6 and totals["whole step"] > 0 and totals["postprocess"] > 0
    if structured:  # every constrained token was drawn from a mask, and the draw is kept out of the engine's time
        assert totals["stub token draw"] > 0
        assert totals["engine step"] == pytest.approx(totals["whole step"] - totals["stub token draw"])
        assert totals["feed matchers ahead"] > 0 and totals["mask dispatch"] > 0
        assert 0 < totals["tokens -> masked sampling queued"] < totals["whole step"]


def test_swap_runs_the_named_methods_of_a_git_revision_on_part_of_the_steps(bench):
    """--swap-from HEAD --swap ...: the steady steps split between this tree's methods and HEAD's (loaded from git),
    each figure reported for both sides; the methods are this tree's again afterwards."""
    from offline_paged.core.scheduler import Scheduler

    mine = Scheduler.__dict__["_schedule"]
    args = bench.parse_args(["--num-requests", "12", "--output-len", "40", "--graphs", "--swap-from", "HEAD",
                             "--swap", "offline_paged.core.scheduler.Scheduler._schedule"])
    num_steps, totals = bench.run_once(args)
    assert totals["steps (tree)"] + totals["steps (ref)"] < num_steps  # the prefill steps are left out
    assert totals["steps (tree)"] >= 5 and totals["steps (ref)"] >= 5
    assert totals["schedule (tree)"] > 0 and totals["schedule (ref)"] > 0 and totals["whole step (ref)"] > 0
    assert Scheduler.__dict__["_schedule"] is mine
    swapped = bench.load_swaps("HEAD", ["offline_paged.core.scheduler.Scheduler._schedule"])
    assert swapped[0][3] is not mine and swapped[0][3].__code__.co_filename.startswith("HEAD:")



def test_decode_steps_wider_than_256_sequences_replay_in_the_stand_in_graphs(bench):
    """--max-num-seqs 300: the stand-in graphs take the engine's buckets for that many sequences (up to 320), so
    decode steps of 257-300 sequences replay (they ran eagerly while its buckets stopped at 256)."""
    engine = bench.build_engine(300, graphs=True, max_num_seqs=300)
    graphs = engine.runner.decode_graphs
    assert graphs.buckets[-1] == 320 and engine.runner.sampling_rows.seeds.shape[0] == 300
    for index, request in enumerate(bench.random_workload(300, input_len=(20, 40), output_len=(4, 4), vocab_size=200)):
        engine.add_request(f"r{index}", prompt_token_ids=request.prompt_token_ids, params=request.params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    assert graphs.largest_replay == 300


def test_the_sharegpt_like_dataset_runs(bench):
    args = bench.parse_args(["--num-requests", "12", "--dataset", "sharegpt-like", "--graphs", "--max-num-seqs", "8"])
    num_steps, totals = bench.run_once(args)
    assert num_steps > 12 and totals["whole step"] > 0 and totals["runner.launch"] > 0


def test_a_job_of_prompt_ids_runs_through_the_job_runner(bench):
    args = bench.parse_args(["--num-requests", "10", "--output-len", "5", "--graphs", "--job", "ids"])
    num_steps, totals = bench.run_once(args)
    assert num_steps >= 5 and totals["job: lines in"] > 0 and totals["job: records out"] > 0
    assert totals["engine.step"] < totals["whole step"]


def test_a_chat_job_renders_and_tokenises_each_line(bench, tmp_path):
    """--job chat: every line is a user message the chat template and the tokenizer turn into the prompt."""
    from fixtures_tiny_model import write_tiny_model

    from offline_paged.benchmark.bench import random_workload

    directory = write_tiny_model(tmp_path / "model")
    args = bench.parse_args(["--num-requests", "4", "--graphs", "--job", "chat", "--tokenizer-dir", str(directory)])
    tokenizer = bench.load_tokenizer(str(directory))[1]
    engine = bench.build_engine(4, graphs=True, tokenizer=tokenizer)
    requests = random_workload(4, input_len=(3, 6), output_len=(2, 4), vocab_size=200)
    lines = bench.job_lines(requests, "chat")
    assert all('"messages"' in line and "prompt_token_ids" not in line for line in lines)
    num_steps, totals = bench.run_job(args, engine, requests, bench.Timer())
    assert num_steps >= 2 and totals["job: lines in"] > 0
    assert engine.stats.num_prompt_tokens > sum(len(r.prompt_token_ids) for r in requests)  # words, template


@pytest.mark.parametrize("argv", [["--job", "chat"], ["--job", "ids", "--structured", "json"],
                                  ["--tokenizer-dir", "x"]])
def test_job_options_that_do_not_go_together_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_the_collector_pacing_ab_runs_both_sides_and_reports_the_pairs(monkeypatch, capsys):
    module = load_script("benchmarks/bench_gc_pacing.py")
    monkeypatch.setattr("sys.argv", ["bench_gc_pacing.py", "2", "--num-requests", "8", "--output-len", "4"])
    module.main()
    lines = capsys.readouterr().out.splitlines()
    runs = [line.split()[2] for line in lines if line.startswith("pair ")]
    assert sorted(runs) == ["default", "default", "paced", "paced"]
    assert lines[-1].startswith("default / paced, each pair:") and lines[-1].endswith("of 2")
