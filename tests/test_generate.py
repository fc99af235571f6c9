"""`offline-paged generate` end to end on a tiny random HF model dir (real engine, CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures_tiny_model import write_tiny_model
from offline_paged.cli.main import cli
from offline_paged.job.job_output import is_error, record_key

REPO = Path(__file__).resolve().parents[1]
CLI_MAIN = "from offline_paged.cli.main import cli; cli()"
ENGINE_FLAGS = ["--device", "cpu", "--block-size", "4", "--num-kv-blocks", "64",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--no-progress"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=64)


def _job(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _generate(model_dir, *args) -> "click.testing.Result":
    return CliRunner().invoke(cli, ["generate", *map(str, args), "--model", str(model_dir),
                                    *ENGINE_FLAGS])


JOB = [
    {"id": "plain", "prompt": "The sky is", "max_tokens": 5, "temperature": 0},
    {"id": "chat", "messages": [{"role": "system", "content": "Short."},
                                {"role": "user", "content": "Hi"}], "n": 2, "seed": 1},
    {"id": "eval", "prompt": "Paris is in France", "max_tokens": 1, "prompt_logprobs": 1},
    {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
     "body": {"model": "x", "prompt": "Once", "max_tokens": 3, "logprobs": 1}},
]


def test_job_writes_one_record_per_line_and_stats(model_dir, tmp_path):
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    result = _generate(model_dir, _job(tmp_path / "in.jsonl", JOB), "-o", out,
                       "--stats-json", stats, "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    records = {record_key(r): r for r in _records(out)}
    assert set(records) == {"plain", "chat", "eval", "oa"}
    assert len(records["plain"]["outputs"][0]["token_ids"]) == 5  # line value beats --max-tokens
    assert [len(o["token_ids"]) for o in records["chat"]["outputs"]] == [4, 4]
    assert len(records["eval"]["prompt_logprobs"]) == len("Paris is in France")
    assert records["oa"]["response"]["body"]["choices"][0]["logprobs"]["tokens"]
    summary = json.loads(stats.read_text())
    assert summary["succeeded"] == 4 and summary["failed"] == 0
    assert summary["engine"]["num_requests_finished"] == 4


def test_greedy_job_is_reproducible_and_matches_the_engine_directly(model_dir, tmp_path):
    from offline_paged.core.config import EngineConfig
    from offline_paged.engine import LLMEngine
    from offline_paged.core.sampling_params import SamplingParams

    job = _job(tmp_path / "in.jsonl", [{"prompt_token_ids": [5, 6, 7], "max_tokens": 6,
                                        "temperature": 0, "ignore_eos": True}])
    _generate(model_dir, job, "-o", tmp_path / "a.jsonl")
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", block_size=4,
                                    num_kv_blocks=64))
    engine.add_request("x", prompt_token_ids=[5, 6, 7],
                       params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    (direct,) = engine.step() + [o for _ in range(10) for o in engine.step()]
    got = _records(tmp_path / "a.jsonl")[0]["outputs"][0]["token_ids"]
    assert got == direct.outputs[0].token_ids and len(got) == 6


def test_bad_prompts_file_gives_one_record_per_line_and_exit_1(model_dir, tmp_path):
    bad = REPO / "data" / "bad_prompts.jsonl"
    lines = [line for line in bad.read_text().splitlines() if line.strip()]
    out = tmp_path / "out.jsonl"
    result = _generate(model_dir, bad, "-o", out, "--max-model-len", "48")
    assert result.exit_code == 1, result.output
    records = _records(out)
    assert len(records) == len(lines)
    assert len({record_key(r) for r in records}) == len(records)
    failed = sum(is_error(r) for r in records)
    assert failed >= len(lines) - 2 and f"{failed} line(s) have error records" in result.output


def test_resume_skips_done_ids_and_no_resume_overwrites(model_dir, tmp_path):
    job = _job(tmp_path / "in.jsonl", [{"id": i, "prompt": "ab", "max_tokens": 2} for i in range(4)])
    out = tmp_path / "out.jsonl"
    first = _records(out) if _generate(model_dir, job, "-o", out).exit_code == 0 else None
    assert first is not None and len(first) == 4
    kept = out.read_text().splitlines(keepends=True)[:2]
    out.write_text("".join(kept) + kept[0][:7])  # two done records and a torn third
    result = _generate(model_dir, job, "-o", out)
    assert result.exit_code == 0 and "cut a torn last line" in result.output
    assert sorted(r["id"] for r in _records(out)) == ["0", "1", "2", "3"]
    assert _generate(model_dir, job, "-o", out, "--no-resume").exit_code == 0
    assert len(_records(out)) == 4


def test_output_that_is_not_ours_is_refused_with_exit_2(model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("hello\n")
    result = _generate(model_dir, _job(tmp_path / "in.jsonl", JOB[:1]), "-o", out)
    assert result.exit_code == 2 and "refusing to resume" in result.output
    assert out.read_text() == "hello\n"


def test_bad_default_flag_is_a_usage_error(model_dir, tmp_path):
    result = _generate(model_dir, _job(tmp_path / "in.jsonl", JOB[:1]), "--top-p", "0")
    assert result.exit_code == 2 and "top_p" in result.output


def test_stdin_to_stdout_in_a_real_process(model_dir):
    line = json.dumps({"id": "s", "prompt": "hey", "max_tokens": 2}) + "\n"
    proc = subprocess.run([sys.executable, "-c", CLI_MAIN, "generate", "-",
                           "--model", str(model_dir), *ENGINE_FLAGS],
                          input=line, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(x) for x in proc.stdout.splitlines()]
    assert record["id"] == "s" and record["usage"]["completion_tokens"] == 2
    assert "requests: 1 (1 ok" in proc.stderr
    assert "engine: cpu float32, max_num_seqs 4, max_num_batched_tokens 32, max_model_len 64, KV pool 64 blocks of 4 " \
           "tokens" in proc.stderr


def test_the_log_names_the_budgets_the_engine_chose(model_dir, tmp_path):
    """Left to the device, the step budgets are the CPU's (256 sequences, 2048 tokens), and the log says so."""
    result = CliRunner().invoke(cli, ["generate", str(_job(tmp_path / "in.jsonl", JOB[:1])), "-o", str(tmp_path / "o"),
                                      "--model", str(model_dir), "--device", "cpu", "--num-kv-blocks", "64",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "engine: cpu float32, max_num_seqs 256, max_num_batched_tokens 2048, max_model_len 64, KV pool 64 blocks " \
           "of 16 tokens" in result.output


# ---------------------------------------------------------------- output faults: exit 2 before any work
MISSING_MODEL = "/nonexistent/model"  # reaching the model would say "cannot start the engine"


def _fault(tmp_path, *args) -> "click.testing.Result":
    result = _generate(MISSING_MODEL, _job(tmp_path / "in.jsonl", JOB[:1]), *args)
    assert result.exit_code == 2 and "cannot start the engine" not in result.output, result.output
    assert "Traceback" not in result.output
    return result


def test_a_device_or_fifo_output_is_refused_by_name(tmp_path):
    assert "/dev/full: the output must be a regular file" in _fault(tmp_path, "-o", "/dev/full").output
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert f"{fifo}: the output must be a regular file" in _fault(tmp_path, "-o", fifo).output


def test_a_missing_output_or_stats_directory_is_refused_by_name(tmp_path):
    assert "does not exist" in _fault(tmp_path, "-o", tmp_path / "no" / "out.jsonl").output
    result = _fault(tmp_path, "-o", tmp_path / "out.jsonl", "--stats-json", tmp_path / "no" / "s.json")
    assert "s.json: directory" in result.output


def test_a_read_only_output_is_refused_by_name(tmp_path, monkeypatch):
    from offline_paged.job import job_file

    def read_only(*args, **kwargs):  # a read-only mount; chmod would not stop root
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(job_file.os, "open", read_only)
    result = _fault(tmp_path, "-o", tmp_path / "out.jsonl")
    assert "out.jsonl: cannot open for writing (Read-only file system)" in result.output


def test_a_second_process_on_the_same_output_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom offline_paged.job.job_file import open_output\n"
         "w, _ = open_output(sys.argv[1], resume=True)\nprint('locked', flush=True)\ntime.sleep(60)",
         str(out)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = _fault(tmp_path, "-o", out, "--no-resume")
        assert f"{out}: another process is writing this output file" in result.output
    finally:
        holder.kill()
        holder.wait()


def test_a_full_output_disk_mid_run_exits_2_with_complete_records_then_resumes(model_dir, tmp_path):
    job = _job(tmp_path / "in.jsonl", [{"id": i, "prompt": "ab", "max_tokens": 3} for i in range(8)])
    out = tmp_path / "out.jsonl"

    def file_size_limit():  # the kernel refuses writes past 400 bytes (EFBIG), as a full disk would
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400, 400))

    command = [sys.executable, "-c", CLI_MAIN, "generate", str(job), "-o", str(out),
               "--model", str(model_dir), *ENGINE_FLAGS]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env,
                          preexec_fn=file_size_limit)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{out}: cannot write (File too large)" in proc.stderr
    partial = out.read_bytes()
    assert partial.endswith(b"\n") and 0 < len(partial) <= 400  # complete records only
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["id"] for r in _records(out)) == [str(i) for i in range(8)]


def test_an_unwritable_stats_file_is_caught_before_the_job(tmp_path):
    stats = tmp_path / "stats.json"
    stats.mkdir()
    result = _generate(MISSING_MODEL, _job(tmp_path / "in.jsonl", JOB[:1]), "-o",
                       tmp_path / "out.jsonl", "--stats-json", stats)
    assert result.exit_code == 2 and "stats.json" in result.output


# ---------------------------------------------------------------- interrupts exit 130
def test_ctrl_c_during_model_load_exits_130_not_aborted(tmp_path, monkeypatch):
    from offline_paged.cli import generate as generate_module

    def interrupted_load(options):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module, "_build_engine", interrupted_load)
    result = _generate(MISSING_MODEL, _job(tmp_path / "in.jsonl", JOB[:1]), "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 130 and "Aborted!" not in result.output


def test_a_second_ctrl_c_during_the_job_exits_130_not_aborted(model_dir, tmp_path, monkeypatch):
    from offline_paged.job.job_runner import JobRunner

    def second_ctrl_c(self, lines):  # what _StopFlag does on the second signal
        raise KeyboardInterrupt

    monkeypatch.setattr(JobRunner, "run", second_ctrl_c)
    result = _generate(model_dir, _job(tmp_path / "in.jsonl", JOB[:1]), "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 130 and "Aborted!" not in result.output
    assert "run the same command to resume" in result.output


def test_repeated_ctrl_c_in_a_real_process_exits_130_and_resume_finishes(model_dir, tmp_path):
    import signal
    import time

    job = _job(tmp_path / "in.jsonl", [{"id": i, "prompt": "abc", "max_tokens": 30,
                                        "ignore_eos": True, "seed": i} for i in range(60)])
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-c", CLI_MAIN, "generate", str(job), "-o", str(out),
               "--model", str(model_dir), *ENGINE_FLAGS]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not (out.exists() and out.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(2):  # the first asks to stop after the step, a second (if still running) aborts
        if proc.poll() is None:  # back to back, so the second lands inside the step, not at exit
            proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and "Aborted!" not in stderr and "Traceback" not in stderr, stderr
    assert subprocess.run(command, capture_output=True, timeout=120, env=env).returncode == 0
    assert sorted(int(r["id"]) for r in _records(out)) == list(range(60))


def test_no_resume_keeps_the_old_output_when_the_model_cannot_load(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "line": 1, "error": null}\n')
    result = _generate(MISSING_MODEL, _job(tmp_path / "in.jsonl", JOB[:1]), "-o", out, "--no-resume")
    assert result.exit_code == 2 and "cannot start the engine" in result.output
    assert out.read_text() == '{"id": "a", "line": 1, "error": null}\n'


def test_disk_full_mid_run_says_disk_full_and_exits_2(model_dir, tmp_path, monkeypatch):
    import errno

    from offline_paged.job.job_file import JsonlWriter

    real_write_all, calls = JsonlWriter._write_all, []

    def fills_up(self, data):  # the third record finds the disk full after half its bytes
        calls.append(data)
        if len(calls) == 3:
            real_write_all(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(self, data)

    monkeypatch.setattr(JsonlWriter, "_write_all", fills_up)
    job = _job(tmp_path / "in.jsonl", [{"id": i, "prompt": "ab", "max_tokens": 2} for i in range(6)])
    out = tmp_path / "out.jsonl"
    result = _generate(model_dir, job, "-o", out)
    assert result.exit_code == 2 and f"{out}: disk full" in result.output
    assert "Traceback" not in result.output
    assert len(_records(out)) == 2 and out.read_bytes().endswith(b"\n")


def test_openai_echo_scoring_agrees_with_a_native_scoring_line(model_dir, tmp_path):
    lines = [{"id": "score", "context": "The sky", "continuation": " is"},
             {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "The sky is", "max_tokens": 0, "echo": True,
                       "logprobs": 1}}]
    out = tmp_path / "out.jsonl"
    result = _generate(model_dir, _job(tmp_path / "in.jsonl", lines), "-o", out)
    assert result.exit_code == 0, result.output
    records = {record_key(r): r for r in _records(out)}
    choice = records["echo"]["response"]["body"]["choices"][0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert choice["text"] == "The sky is" and token_logprobs[0] is None
    assert len(token_logprobs) == len("The sky is")  # one token per byte in the tiny vocabulary
    score = records["score"]
    assert score["num_tokens"] == 3
    assert score["loglikelihood"] == pytest.approx(sum(token_logprobs[-3:]), abs=1e-5)
