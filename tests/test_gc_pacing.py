"""gc_pacing: the collector's thresholds while a step loop runs, and the caller's own after; and the loops that
enter it (the job runner, LLM, a data-parallel worker, the bench) step with them."""
from __future__ import annotations

import gc
import threading

import pytest
from fake_engine import FakeEngine
from tiny_engine import VOCAB_SIZE, tiny_model

from offline_paged.core import gc_pacing
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine

CALLERS = (900, 11, 12)  # a caller's own thresholds, unlike CPython's default and the loops'


@pytest.fixture
def callers_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(*CALLERS)
    yield
    gc.set_threshold(*saved)


@pytest.fixture
def steps_record_thresholds(monkeypatch):
    """Every LLMEngine step notes the thresholds it ran under."""
    seen = []
    step = LLMEngine.step_with_report

    def recording(self):
        seen.append(gc.get_threshold())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step_with_report", recording)
    return seen


def test_a_loop_runs_at_the_step_loop_thresholds_and_gives_the_callers_back(callers_thresholds):
    with gc_pacing.paced():
        assert gc.get_threshold() == gc_pacing.STEP_LOOP_THRESHOLDS
    assert gc.get_threshold() == CALLERS


def test_nested_loops_restore_only_when_the_outermost_leaves_even_by_an_exception(callers_thresholds):
    with pytest.raises(KeyError):
        with gc_pacing.paced():
            with gc_pacing.paced():
                pass
            assert gc.get_threshold() == gc_pacing.STEP_LOOP_THRESHOLDS
            raise KeyError("a step failed")
    assert gc.get_threshold() == CALLERS


def test_loops_on_two_threads_share_one_scope(callers_thresholds):
    """Thread A enters, B enters, A leaves: still paced for B; B leaves: the caller's thresholds again."""
    pacing = gc_pacing.CollectorPacing((5_000, 7, 9))
    a_in, b_in, a_out, b_may_leave = (threading.Event() for _ in range(4))
    seen = {}

    def thread_a():
        with pacing.paced():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with pacing.paced():
            b_in.set()
            a_out.wait(10)
            seen["after a left"] = gc.get_threshold()
            b_may_leave.wait(10)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    a_out.wait(10)
    b_may_leave.set()
    for thread in threads:
        thread.join(10)
    assert seen["after a left"] == (5_000, 7, 9)
    assert gc.get_threshold() == CALLERS


@pytest.mark.parametrize("thresholds", [(0, 10, 10), (700, 10), (700, -1, 10)])
def test_thresholds_that_are_not_three_positive_ints_are_refused(thresholds):
    with pytest.raises(ValueError, match="three positive ints"):
        gc_pacing.CollectorPacing(thresholds)


def test_the_job_runner_steps_at_the_step_loop_thresholds(callers_thresholds):
    import io

    from offline_paged.job.job_file import JsonlWriter
    from offline_paged.job.job_runner import JobRunner

    seen = []

    class Recording(FakeEngine):
        def step(self):
            seen.append(gc.get_threshold())
            return super().step()

    JobRunner(Recording(), JsonlWriter(io.BytesIO())).run(['{"prompt": "abc"}', '{"prompt": "de"}'])
    assert seen and set(seen) == {gc_pacing.STEP_LOOP_THRESHOLDS}
    assert gc.get_threshold() == CALLERS


def test_llm_generate_steps_at_the_step_loop_thresholds(callers_thresholds, steps_record_thresholds, tmp_path):
    from fixtures_tiny_model import write_tiny_model

    from offline_paged import LLM

    llm = LLM(model=str(write_tiny_model(tmp_path / "model", seed=3)), device="cpu", dtype="float32")
    llm.generate(["a prompt"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert steps_record_thresholds and set(steps_record_thresholds) == {gc_pacing.STEP_LOOP_THRESHOLDS}
    assert gc.get_threshold() == CALLERS


def test_the_bench_steps_at_the_step_loop_thresholds(callers_thresholds, steps_record_thresholds):
    from offline_paged.benchmark.bench import random_workload, run_bench

    engine = LLMEngine(EngineConfig(device="cpu", block_size=4, num_kv_blocks=40, max_model_len=40,
                                    max_num_batched_tokens=64), loaded_model=tiny_model())
    run_bench(engine, random_workload(3, (4, 8), (2, 4), vocab_size=VOCAB_SIZE, seed=1))
    assert steps_record_thresholds and set(steps_record_thresholds) == {gc_pacing.STEP_LOOP_THRESHOLDS}
    assert gc.get_threshold() == CALLERS


def test_a_data_parallel_worker_steps_at_the_step_loop_thresholds(callers_thresholds, steps_record_thresholds,
                                                                   tmp_path):
    from fixtures_tiny_model import write_tiny_model
    from test_dp_worker import REQUESTS, _serve_in_this_process

    from offline_paged.dp.dp_worker import WorkerSpec

    def drive(conn):
        assert conn.recv()[0] == "ready"
        conn.send(("add", REQUESTS[1:]))
        while not conn.recv()[1]:  # stats only, until the request's result
            pass
        conn.send(("stop",))

    config = EngineConfig(model=str(write_tiny_model(tmp_path / "model", seed=5)), device="cpu", dtype="float64",
                          block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=32)
    _serve_in_this_process(WorkerSpec(config), drive)
    assert steps_record_thresholds and set(steps_record_thresholds) == {gc_pacing.STEP_LOOP_THRESHOLDS}
    assert gc.get_threshold() == CALLERS


def test_a_tensor_parallel_rank_replays_at_the_step_loop_thresholds(callers_thresholds):
    from test_tp_worker import _Rank, _source, _spec

    from offline_paged.tp.tp_messages import InitRunner, Loaded, Ready, Stop

    rank = _Rank(_spec(_source()))  # on a thread: the thresholds are the process's
    assert rank.control.recv() == Loaded()
    rank.control.send(InitRunner(8, 0, 32, 2))
    assert rank.control.recv() == Ready()
    assert gc.get_threshold() == gc_pacing.STEP_LOOP_THRESHOLDS  # serving
    rank.control.send(Stop())
    assert rank.join() == "returned"
    assert gc.get_threshold() == CALLERS
