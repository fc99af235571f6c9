"""One data-parallel worker (dp/dp_worker.py) driven by hand over a pipe, in this process: ready with its
max_model_len and pid, the outputs of a single engine, a refused request as a RequestError, abort,
stop; a worker that cannot build its engine says ("failed", ...). Worker processes under the
coordinator are tested in test_dp_coordinator.py."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from fixtures_tiny_model import write_tiny_model
from offline_paged.core.config import EngineConfig
from offline_paged.core.outputs import EngineStats, RequestError
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.dp.dp_worker import WorkerSpec, WorkRequest, run_worker
from offline_paged.engine import LLMEngine


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float64", block_size=4,
                        num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=32)


def _serve_in_this_process(spec: WorkerSpec, drive, visible_device=None) -> None:
    """run_worker on this (main) thread, as its process would, while `drive(conn)` talks to it from
    another thread; SIGINT's handler is restored afterwards (the worker ignores Ctrl-C)."""
    conn, child = multiprocessing.Pipe()
    errors = []

    def driver():
        try:
            drive(conn)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)
            conn.close()

    thread = threading.Thread(target=driver, daemon=True)
    handler = signal.getsignal(signal.SIGINT)
    thread.start()
    try:
        run_worker(0, visible_device, spec, child)
    finally:
        signal.signal(signal.SIGINT, handler)
    thread.join(timeout=60)
    if errors:
        raise errors[0]


REQUESTS = [WorkRequest("greedy", "a prompt", None, SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0)),
            WorkRequest("sampled", None, [5, 9, 11, 3], SamplingParams(max_tokens=5, ignore_eos=True, seed=3))]


def _single_engine(config) -> dict[str, list[list[int]]]:
    engine = LLMEngine(config)
    for r in REQUESTS:
        engine.add_request(r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids, params=r.params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = [c.token_ids for c in output.outputs]
    return tokens


def test_a_worker_gives_the_single_engine_outputs_and_refuses_a_bad_request_alone(config):
    seen = {}

    def drive(conn):
        kind, max_model_len, pid = conn.recv()
        assert kind == "ready" and max_model_len > 0 and pid == os.getpid()
        conn.send(("add", [*REQUESTS, WorkRequest("bad", None, [10 ** 6], SamplingParams(max_tokens=2))]))
        while len(seen) < 3:
            kind, results, stats = conn.recv()
            assert kind == "results" and isinstance(stats, EngineStats)
            for result in results:
                seen[result.request_id] = result
        conn.send(("stop",))

    _serve_in_this_process(WorkerSpec(config), drive)
    assert isinstance(seen["bad"], RequestError) and "prompt_token_ids" in seen["bad"].message
    want = _single_engine(config)
    assert {rid: [c.token_ids for c in seen[rid].outputs] for rid in want} == want


def test_an_aborted_request_never_comes_back_and_a_closed_pipe_ends_the_worker(config):
    def drive(conn):
        assert conn.recv()[0] == "ready"
        long = SamplingParams(max_tokens=60, ignore_eos=True)
        conn.send(("add", [WorkRequest("long", None, [4, 5, 6], long), REQUESTS[0]]))
        conn.send(("abort", "long"))
        finished = []
        while "greedy" not in finished:
            finished += [r.request_id for r in conn.recv()[1]]
        assert "long" not in finished
        # Aborted, the worker is idle and sends nothing more; not aborted, "long" would come back.
        while conn.poll(3.0):
            assert "long" not in [r.request_id for r in conn.recv()[1]]
        conn.close()  # the coordinator is gone: the worker must return, not hang

    _serve_in_this_process(WorkerSpec(config), drive)


def test_a_worker_that_cannot_build_its_engine_says_failed_and_pins_its_device(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    missing = tmp_path / "no-such-model"
    replies = []
    spec = WorkerSpec(EngineConfig(model=str(missing), device="cpu"), cpu_threads=2)
    _serve_in_this_process(spec, lambda conn: replies.append(conn.recv()), visible_device="3")
    assert len(replies) == 1 and replies[0][0] == "failed" and "no-such-model" in replies[0][1]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert os.environ["OMP_NUM_THREADS"] == "5"  # set by the user: kept
    assert os.environ["OPENBLAS_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "2"
