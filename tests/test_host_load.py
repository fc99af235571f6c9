"""host_load.py: the step loop thread's CPU time and context switches, and the host's steal, over a bench run."""
import json
import time

from tiny_engine import VOCAB_SIZE, tiny_engine

from offline_paged.benchmark import bench
from offline_paged.benchmark.bench import random_workload, run_bench, warm_up
from offline_paged.benchmark.bench_report import format_details
from offline_paged.benchmark.host_load import LoadSnapshot, _cpu_ticks, _last_cpu, over_run

# /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
STAT = "cpu  1000 10 300 8000 50 5 5 130 40 0\ncpu0 500 5 150 4000 25 2 2 65 20 0\n"


def test_cpu_ticks_read_steal_and_the_total_without_guest(tmp_path):
    path = tmp_path / "stat"
    path.write_text(STAT)
    assert _cpu_ticks(str(path)) == (130, 1000 + 10 + 300 + 8000 + 50 + 5 + 5 + 130)
    path.write_text("cpu  1 2 3 4\n")  # an old kernel's short line: no steal field
    assert _cpu_ticks(str(path)) == (None, None)
    assert _cpu_ticks(str(tmp_path / "missing")) == (None, None)


def test_last_cpu_counts_fields_after_a_command_name_with_spaces(tmp_path):
    fields = [str(n) for n in range(3, 53)]  # fields 3..52, each its own number: field 39 reads 39
    path = tmp_path / "stat"
    path.write_text(f"4242 (python3 step (loop)) {' '.join(fields)}\n")
    assert _last_cpu(str(path)) == 39
    assert _last_cpu(str(tmp_path / "missing")) is None


def test_over_run_per_step_and_shares():
    before = LoadSnapshot(7.0, 1.0, 10, 4, 100, 10_000, 3)
    after = LoadSnapshot(9.0, 1.5, 30, 24, 150, 11_000, 5)
    load = over_run(before, after, num_steps=100)
    assert load == {"thread_cpu_ms": 5.0, "thread_cpu_share": 0.25, "voluntary_switches": 0.2,
                    "involuntary_switches": 0.2, "host_steal_share": 0.05, "cpu_first": 3, "cpu_last": 5}
    unknown = LoadSnapshot(7.0, 1.0, None, None, None, None, None)
    load = over_run(unknown, unknown, num_steps=0)
    assert load["involuntary_switches"] is None and load["host_steal_share"] is None
    assert load["thread_cpu_share"] is None and load["thread_cpu_ms"] == 0.0


def test_a_snapshot_on_this_host_counts_this_threads_work():
    before = LoadSnapshot.take()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # 50 ms of this thread's CPU
        pass
    load = over_run(before, LoadSnapshot.take(), num_steps=10)
    assert load["thread_cpu_ms"] >= 5.0  # 50 ms over 10 steps
    assert 0.5 < load["thread_cpu_share"] <= 1.01  # (one busy thread: its CPU time is nearly all the wall)
    assert load["involuntary_switches"] is not None and load["host_steal_share"] is not None  # (Linux)
    assert isinstance(load["cpu_first"], int)


def test_a_bench_record_carries_the_host_load_when_asked(monkeypatch):
    engine = tiny_engine()
    warm_up(engine, VOCAB_SIZE)
    requests = random_workload(8, (4, 16), (4, 12), vocab_size=VOCAB_SIZE, seed=2)
    assert bench.RECORD_HOST_LOAD is True  # (on by default)
    monkeypatch.setattr(bench, "RECORD_HOST_LOAD", False)
    assert json.loads(run_bench(engine, requests).to_json())["host_load"] is None
    monkeypatch.setattr(bench, "RECORD_HOST_LOAD", True)
    result = run_bench(engine, random_workload(8, (4, 16), (4, 12), vocab_size=VOCAB_SIZE, seed=2))
    load = json.loads(result.to_json())["host_load"]
    assert load["thread_cpu_ms"] > 0 and 0 < load["thread_cpu_share"] < 1.5
    assert any(line.startswith("step loop thread: ") for line in format_details(result))
