"""The hostile corpus (tests/data/hostile_jobs.jsonl, written by scripts/make_hostile_corpus.py)
through the real CLI on a tiny model: one record per non-blank line, no traceback, exit 1, bounded
CPU time and memory, and a rerun resumes instead of crashing again."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_scripts import load_script
from fixtures_tiny_model import write_tiny_model
from offline_paged.job.job_output import is_error, record_key

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "data" / "hostile_jobs.jsonl"
# The CLI, reporting at exit its own peak RSS (VmHWM of its own address space) and its own CPU seconds
# (bounded work that a loaded machine does not inflate, unlike the wall clock). (getrusage is no good for RSS
# here: RUSAGE_CHILDREN counts every earlier child, and Linux carries ru_maxrss across fork + exec, so
# RUSAGE_SELF starts at the size of the pytest process that forked it.)
CLI_MAIN = ("import atexit, os, re, sys\n"
            "def _peak():\n"
            "    status = open('/proc/self/status').read()\n"
            "    print('peak_rss_kib=' + re.search(r'VmHWM:\\s+(\\d+)', status).group(1), file=sys.stderr)\n"
            "    times = os.times()\n"
            "    print(f'cpu_s={times.user + times.system:.2f}', file=sys.stderr)\n"
            "atexit.register(_peak)\n"
            "from offline_paged.cli.main import cli; cli()")
MAX_CPU_S = 180  # the CLI's own CPU seconds, generous: the point is "no runaway work"
HANG_GUARD_S = 900  # wall clock, only so that a hang ends the test; never asserted against
MAX_RSS_BYTES = 3 * 2**30  # generous: the point is "no blow-up" (n = 10**12 once grew past 5 GB)
SUCCEED = {"good-after-bom", "good-1", "good-2", "good-last", "cr-between-tokens", "crlf-ending",
           "max-tokens-1e30", "top-k-1e30", "score-ok", "echo-ok", "temperature-5e-324"}


def _corpus_script():
    return load_script("scripts/make_hostile_corpus.py")


def _non_blank_lines(data: bytes) -> int:
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    return sum(1 for line in lines if line.strip(b" \t\r\n"))


def test_the_committed_corpus_is_what_the_script_writes():
    assert CORPUS.read_bytes() == _corpus_script().build(), \
        "run scripts/make_hostile_corpus.py and commit tests/data/hostile_jobs.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=64)


def _run(model_dir: Path, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", CLI_MAIN, "generate", str(CORPUS), "-o", str(out),
               "--model", str(model_dir), "--device", "cpu", "--block-size", "4",
               "--num-kv-blocks", "128", "--max-num-seqs", "8", "--no-progress",
               "--max-line-bytes", str(_corpus_script().MAX_LINE_BYTES)]
    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_every_hostile_line_gets_one_record_and_the_job_finishes(model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = _run(model_dir, out)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert float(re.search(r"cpu_s=([\d.]+)", proc.stderr).group(1)) < MAX_CPU_S
    assert int(re.search(r"peak_rss_kib=(\d+)", proc.stderr).group(1)) * 1024 < MAX_RSS_BYTES
    records = [json.loads(line) for line in out.read_bytes().decode("utf-8").splitlines()]
    assert len(records) == _non_blank_lines(CORPUS.read_bytes())
    keys = [record_key(r) for r in records]
    assert len(set(keys)) == len(keys)
    succeeded = {record_key(r) for r in records if not is_error(r)}
    assert succeeded == SUCCEED
    assert all(len(json.dumps(r)) < 10_000 for r in records)  # no 86 MB records

    rerun = _run(model_dir, out)  # a crash used to repeat on every rerun
    assert rerun.returncode == 1 and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
    assert f"{len(records)} already done" in rerun.stderr
    assert len(out.read_bytes().splitlines()) == len(records)
