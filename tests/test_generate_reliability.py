"""Issue 29's CLI rows: files compared by identity, bounded lines end to end, exit codes that tell a
crash from failed lines, signals (SIGHUP, a signal during shutdown) and option edges."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures_tiny_model import write_tiny_model
from offline_paged.cli.main import EXIT_INTERNAL, cli

REPO = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--device", "cpu", "--block-size", "4", "--num-kv-blocks", "64",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--no-progress"]
MISSING_MODEL = "/nonexistent/model"  # reaching the model would say "cannot start the engine"
LINES = [{"id": "a", "prompt": "The sky is", "max_tokens": 2}, {"id": "b", "prompt": "Hi", "max_tokens": 2}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=64)


def _job(path: Path, lines=LINES) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _generate(model, *args):
    return CliRunner().invoke(cli, ["generate", *map(str, args), "--model", str(model), *ENGINE_FLAGS])


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


# ---------------------------------------------------------------- the same file under two names
@pytest.mark.parametrize("resume", ["--resume", "--no-resume"])
def test_a_hard_link_of_the_input_as_output_is_refused_and_the_input_kept(tmp_path, resume):
    job = _job(tmp_path / "in.jsonl")
    before = job.read_bytes()
    os.link(job, tmp_path / "link.jsonl")
    result = _generate(MISSING_MODEL, job, "-o", tmp_path / "link.jsonl", resume)
    assert result.exit_code == 2 and "the input and the output are the same file" in result.output, result.output
    assert job.read_bytes() == before


def test_a_hard_link_of_the_input_as_stats_json_is_refused(tmp_path):
    job = _job(tmp_path / "in.jsonl")
    before = job.read_bytes()
    os.link(job, tmp_path / "stats.json")
    result = _generate(MISSING_MODEL, job, "-o", tmp_path / "out.jsonl", "--stats-json", tmp_path / "stats.json")
    assert result.exit_code == 2 and "the input and --stats-json are the same file" in result.output
    assert job.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


def test_an_output_that_is_a_model_file_is_refused_and_the_model_kept(model_dir, tmp_path):
    config = model_dir / "config.json"
    before = config.read_bytes()
    result = _generate(model_dir, _job(tmp_path / "in.jsonl"), "-o", config, "--no-resume")
    assert result.exit_code == 2 and "the model's file config.json are the same file" in result.output
    assert config.read_bytes() == before


def test_stdin_that_is_the_output_file_is_refused(tmp_path):
    job = _job(tmp_path / "in.jsonl")
    before = job.read_bytes()
    with open(job, "rb") as stdin:
        proc = subprocess.run([sys.executable, "-c", "from offline_paged.cli.main import cli; cli()", "generate", "-", "-o", str(job),
                               "--model", MISSING_MODEL, "--device", "cpu"],
                              stdin=stdin, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 2 and "the input and the output are the same file" in proc.stderr, proc.stderr
    assert job.read_bytes() == before


def test_a_character_device_input_is_refused(tmp_path):
    result = _generate(MISSING_MODEL, "/dev/zero", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "/dev/zero: the input must be a regular file, a pipe or '-'" in result.output


# ---------------------------------------------------------------- bounded lines end to end
def test_an_over_long_line_gets_its_record_and_a_resume_passes_it(model_dir, tmp_path):
    job = tmp_path / "in.jsonl"
    job.write_text(json.dumps(LINES[0]) + "\n" + json.dumps({"id": "huge", "prompt": "x " * 50_000}) + "\n"
                   + json.dumps(LINES[1]) + "\n")
    out = tmp_path / "out.jsonl"
    for _ in range(2):  # the rerun skips it instead of dying on it again
        result = _generate(model_dir, job, "-o", out, "--max-line-bytes", "10000")
        assert result.exit_code == 1, result.output
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"a", "line-2", "b"}
    assert records["line-2"]["error"]["type"] == "line_too_long"


# ---------------------------------------------------------------- exit codes and signals
def test_an_internal_failure_exits_3_not_1(model_dir, tmp_path, monkeypatch):
    from offline_paged.job.job_runner import JobRunner

    def crash(self, lines):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(JobRunner, "run", crash)
    result = _generate(model_dir, _job(tmp_path / "in.jsonl"), "-o", tmp_path / "out.jsonl")
    assert result.exit_code == EXIT_INTERNAL == 3, result.output
    assert "RuntimeError: an invariant broke" in result.output and "internal error" in result.output


def test_max_pending_must_be_at_least_one(tmp_path):
    result = _generate(MISSING_MODEL, _job(tmp_path / "in.jsonl"), "-o", tmp_path / "out.jsonl", "--max-pending", "0")
    assert result.exit_code == 2 and "--max-pending" in result.output


def _popen(model_dir, job, out, preamble=""):
    code = preamble + "from offline_paged.cli.main import cli; cli()"
    command = [sys.executable, "-c", code, "generate", str(job), "-o", str(out), "--model", str(model_dir),
               *ENGINE_FLAGS]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())


def _long_job(path: Path) -> Path:
    return _job(path, [{"id": i, "prompt": "abc", "max_tokens": 30, "ignore_eos": True, "seed": i}
                       for i in range(60)])


def test_sighup_stops_the_job_like_sigterm_and_a_rerun_finishes(model_dir, tmp_path):
    job, out = _long_job(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    proc = _popen(model_dir, job, out)
    hang_guard = time.monotonic() + 120  # only so that a hang ends the test; never asserted
    while proc.poll() is None and not (out.exists() and out.stat().st_size) and time.monotonic() < hang_guard:
        time.sleep(0.01)
    proc.send_signal(signal.SIGHUP)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    rerun = _popen(model_dir, job, out)
    rerun.communicate(timeout=300)
    assert rerun.returncode == 0
    assert sorted(int(json.loads(line)["id"]) for line in out.read_text().splitlines()) == list(range(60))


def test_a_sigterm_during_shutdown_still_exits_130(model_dir, tmp_path):
    """The signal lands while the summary is written, after the job loop gave its handlers back."""
    preamble = ("import os, signal, time\n"
                "import offline_paged.cli.generate as g\n"
                "_report = g._report\n"
                "def report(*args):\n"
                "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(1); _report(*args)\n"
                "g._report = report\n")
    proc = _popen(model_dir, _job(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", preamble)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, (proc.returncode, stderr)


def test_an_output_inside_the_default_models_cache_dir_is_refused(tmp_path, monkeypatch):
    from offline_paged.models.default_model import default_model_dir

    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path / "cache"))
    weights = default_model_dir() / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    result = CliRunner().invoke(cli, ["generate", str(_job(tmp_path / "in.jsonl")), "-o", str(weights),
                                      "--no-resume", "--device", "cpu"])
    assert result.exit_code == 2 and "model.safetensors are the same file" in result.output, result.output
    assert weights.read_bytes() == b"weights"


def test_an_interrupted_job_writing_to_stdout_does_not_promise_a_resume(model_dir, tmp_path, monkeypatch):
    from offline_paged.job.job_runner import JobRunner

    def second_ctrl_c(self, lines):
        raise KeyboardInterrupt

    monkeypatch.setattr(JobRunner, "run", second_ctrl_c)
    result = _generate(model_dir, _job(tmp_path / "in.jsonl"), "-o", "-")
    assert result.exit_code == 130
    assert "no file to resume from" in result.output and "run the same command" not in result.output


def test_the_progress_bar_counts_lines_in_chunks_as_the_naive_count_would(tmp_path):
    from offline_paged.cli.generate import count_lines

    path = tmp_path / "in.jsonl"
    cases = [b"", b"\n", b"a\n\n \t\r\nb", b"x" * (3 * 2**20) + b"\n  \n" + b" " * 2**20 + b"y\n",
             b"\r\n" * 5 + b" " * (2**20 - 1) + b"\nz"]
    for data in cases:
        path.write_bytes(data)
        naive = sum(1 for line in data.split(b"\n") if line.strip(b" \t\r\n"))
        assert count_lines(str(path)) == naive, data[:40]
