"""`offline-paged generate --data-parallel-size 2` end to end on the CPU (tiny random model, fp64):
records equal a single-engine run, bad lines still give one error record each, a worker SIGKILLed
mid-job loses nothing, and a SIGKILLed coordinator resumes with every id exactly once."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures_tiny_model import write_tiny_model
from offline_paged.cli.main import cli

REPO = Path(__file__).resolve().parents[1]
CLI_MAIN = "from offline_paged.cli.main import cli; cli()"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "128",
                "--max-num-seqs", "2", "--max-model-len", "64", "--no-progress"]
NUM_LINES = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _write_job(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _long_job(path: Path) -> Path:
    return _write_job(path, [{"id": f"r{i}", "prompt": f"prompt number {i}", "max_tokens": 40,
                              "ignore_eos": True, "seed": i, "temperature": 0.0 if i % 3 else 1.0}
                             for i in range(NUM_LINES)])


def _by_key(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [f"{r.get('custom_id') or r['id']}@{r.get('line')}" for r in records]  # a duplicate id has its own line
    assert len(keys) == len(set(keys)), "a line was written twice"
    return dict(zip(keys, records))


def _content(record: dict):
    """What must not depend on which engine ran the line (fp64: logprobs to rounding)."""
    if record.get("response"):
        body = record["response"]["body"]
        return [c.get("text") for c in body.get("choices", [])] or body
    if record.get("error"):
        return record["error"]
    return [(o["token_ids"], o["text"], o["finish_reason"], round(o["cumulative_logprob"], 9))
            for o in record["outputs"]]


def _command(model_dir, job, out, *extra) -> list[str]:
    return [sys.executable, "-c", CLI_MAIN, "generate", str(job), "-o", str(out),
            "--model", str(model_dir), *ENGINE_FLAGS, *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _reference(model_dir, job, tmp_path) -> dict[str, dict]:
    out = tmp_path / "reference.jsonl"
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(out), "--model", str(model_dir),
                                      *ENGINE_FLAGS])
    assert result.exit_code in (0, 1), result.output
    return _by_key(out)


def test_data_parallel_records_equal_one_engine_and_bad_lines_fail_alone(model_dir, tmp_path):
    job = _write_job(tmp_path / "job.jsonl", [
        *({"id": f"g{i}", "prompt": f"The sky {i} is", "max_tokens": 6, "temperature": 0} for i in range(6)),
        *({"id": f"s{i}", "prompt": f"Once {i}", "max_tokens": 6, "seed": i, "n": 2} for i in range(4)),
        {"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 3},
        "not json",
        {"id": "too-long", "prompt_token_ids": [1] * 70, "max_tokens": 2},  # refused by a worker
        {"id": "g0", "prompt": "duplicate id"},
        {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "Once", "max_tokens": 3, "temperature": 0}},
    ])
    want = _reference(model_dir, job, tmp_path)
    out, stats = tmp_path / "dp.jsonl", tmp_path / "stats.json"
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(out), "--model", str(model_dir),
                                      *ENGINE_FLAGS, "--data-parallel-size", "2", "--stats-json", str(stats)])
    assert result.exit_code == 1, result.output  # some lines have error records
    got = _by_key(out)
    assert got.keys() == want.keys() and len(got) == 15
    for key in want:
        assert _content(got[key]) == _content(want[key]), key
    too_long = got["too-long@13"]["error"]
    assert too_long["type"] == "rejected" and "max_model_len" in too_long["message"]
    summary = json.loads(stats.read_text())
    assert (summary["requests"], summary["succeeded"], summary["failed"]) == (15, 12, 3)
    assert summary["engine"]["num_requests_finished"] == 12  # both workers' stats, added up


@pytest.mark.parametrize("size, message", [("0", "'--data-parallel-size': 0 is not in the range x>=1"),
                                           ("-2", "'--data-parallel-size': -2 is not in the range x>=1")])
def test_bad_data_parallel_size_exits_2_with_the_reason(model_dir, tmp_path, size, message):
    job = _write_job(tmp_path / "job.jsonl", [{"prompt": "x"}])
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(tmp_path / "o.jsonl"),
                                      "--model", str(model_dir), *ENGINE_FLAGS,
                                      "--data-parallel-size", size])
    assert result.exit_code == 2
    assert message in result.output


def test_more_workers_than_gpus_exits_2(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("offline_paged.dp.dp_coordinator._visible_gpus", lambda: ["0"])
    job = _write_job(tmp_path / "job.jsonl", [{"prompt": "x"}])
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(tmp_path / "o.jsonl"),
                                      "--model", str(model_dir), "--device", "cuda",
                                      "--data-parallel-size", "2"])
    assert result.exit_code == 2
    assert "larger than the 1 visible GPU" in result.output


def _num_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _worker_pids(stderr_path: Path, count: int) -> list[int]:
    _wait_for(lambda: len(re.findall(r"ready \(pid (\d+)", stderr_path.read_text())) == count)
    return [int(p) for p in re.findall(r"ready \(pid (\d+)", stderr_path.read_text())]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] == "Z"  # a zombie has exited


def test_worker_sigkilled_mid_job_every_id_once_and_records_unchanged(model_dir, tmp_path):
    job = _long_job(tmp_path / "job.jsonl")
    want = _reference(model_dir, job, tmp_path)
    out, err = tmp_path / "out.jsonl", tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        proc = subprocess.Popen(_command(model_dir, job, out, "--data-parallel-size", "2"),
                                stdout=subprocess.DEVNULL, stderr=err_file, env=_env())
        pids = _worker_pids(err, 2)
        _wait_for(lambda: _num_lines(out) >= 3 or proc.poll() is not None)
        assert proc.poll() is None, "the job ended before a worker could be killed"
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=120) == 0, err.read_text()
    assert "worker 0" in err.read_text() and "died" in err.read_text()
    got = _by_key(out)
    assert got.keys() == want.keys()
    assert all(_content(got[k]) == _content(want[k]) for k in want)


def test_coordinator_sigkilled_then_resumed_every_id_once_and_workers_exit(model_dir, tmp_path):
    job = _long_job(tmp_path / "job.jsonl")
    want = _reference(model_dir, job, tmp_path)
    out = tmp_path / "out.jsonl"
    for target in (2, 9):
        err = tmp_path / f"stderr{target}.txt"
        with open(err, "w") as err_file:
            proc = subprocess.Popen(_command(model_dir, job, out, "--data-parallel-size", "2"),
                                    stdout=subprocess.DEVNULL, stderr=err_file, env=_env())
            pids = _worker_pids(err, 2)
            _wait_for(lambda: _num_lines(out) >= target or proc.poll() is not None)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        _wait_for(lambda: all(_gone(pid) for pid in pids), timeout=30)  # no orphaned engines
    assert 0 < _num_lines(out) < NUM_LINES
    final = subprocess.run(_command(model_dir, job, out, "--data-parallel-size", "2"),
                           capture_output=True, text=True, timeout=120, env=_env())
    assert final.returncode == 0, final.stderr
    assert "resuming" in final.stderr
    got = _by_key(out)
    assert got.keys() == want.keys()
    assert all(_content(got[k]) == _content(want[k]) for k in want)


def test_a_worker_that_cannot_load_the_model_fails_the_start_with_its_reason(tmp_path):
    broken = write_tiny_model(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # the tokenizer still loads
    job = _write_job(tmp_path / "job.jsonl", [{"prompt": "x"}])
    out = tmp_path / "o.jsonl"
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(out), "--model", str(broken),
                                      *ENGINE_FLAGS, "--data-parallel-size", "2"])
    assert result.exit_code == 2
    assert "cannot start the engine: data-parallel worker" in result.output
    assert "model.safetensors" in result.output
    assert out.read_text() == ""
