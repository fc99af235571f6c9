"""Kill the real CLI with SIGKILL at random points, resume each time: every id exactly once,
and the records equal those of an uninterrupted run (requests are seeded, so content matches)."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures_tiny_model import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
CLI_MAIN = "from offline_paged.cli.main import cli; cli()"
NUM_LINES = 40
NUM_KILLS = 4


def _command(model_dir: Path, job: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", CLI_MAIN, "generate", str(job), "-o", str(out),
            "--model", str(model_dir), "--device", "cpu", "--block-size", "4",
            "--num-kv-blocks", "128", "--max-num-seqs", "2", "--no-progress"]


def _start(model_dir, job, out) -> subprocess.Popen:
    return subprocess.Popen(_command(model_dir, job, out), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})


def _num_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _kill_after_lines(proc: subprocess.Popen, out: Path, target: int, rng: random.Random) -> None:
    """SIGKILL once OUT holds `target` lines (plus a random few ms), or leave a finished process."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and _num_lines(out) < target and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.03))
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def _by_id(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in records}


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_gives_every_id_exactly_once(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"prompt number {i}",
                                       "max_tokens": 40, "ignore_eos": True, "seed": i}) + "\n"
                           for i in range(NUM_LINES)))
    reference = tmp_path / "reference.jsonl"
    assert subprocess.run(_command(model_dir, job, reference), capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}).returncode == 0
    out = tmp_path / "out.jsonl"
    rng = random.Random(1234)
    for kill in range(NUM_KILLS):
        done = _num_lines(out)
        _kill_after_lines(_start(model_dir, job, out), out, done + rng.randint(1, 6), rng)
        if kill == 1:  # a kill inside write() is rare to hit; make one torn tail for sure
            with open(out, "ab") as f:
                f.write(b'{"id": "r99", "line": 3, "te')
    final = subprocess.run(_command(model_dir, job, out), capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert final.returncode == 0, final.stderr
    got, want = _by_id(out), _by_id(reference)
    assert set(got) == {f"r{i}" for i in range(NUM_LINES)}
    for request_id, record in want.items():
        # float32 logprobs move in the last bits with batch composition; tokens must not
        for mine, theirs in zip(got[request_id]["outputs"], record["outputs"], strict=True):
            assert mine["token_ids"] == theirs["token_ids"], request_id
            assert mine["cumulative_logprob"] == pytest.approx(theirs["cumulative_logprob"],
                                                               rel=1e-4)
