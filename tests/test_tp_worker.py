"""A tensor-parallel rank > 0 (tp/tp_worker.py) driven by hand over pipes, on a thread: loaded -> init ->
ready -> stop; a shard that cannot load is reported as Failed(...); an unknown message ends the rank
with exit code 1; a vanished rank 0 ends it quietly. Steps with collectives run in
test_tensor_parallel_engine.py (two spawned CPU ranks)."""
from __future__ import annotations

import multiprocessing
import threading

import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.tp.tp_communicator import PipeCommunicator
from offline_paged.tp.tp_messages import Failed, InitRunner, Loaded, Ready, Stop
from offline_paged.tp.tp_worker import TPWorkerSpec, _communicator, run_tp_worker
from offline_paged.models.tp_source import ArraySource
from test_tensor_parallel import random_model


def _spec(source, rank: int = 1) -> TPWorkerSpec:
    config = EngineConfig(device="cpu", dtype="float64", tensor_parallel_size=2, num_kv_blocks=8)
    return TPWorkerSpec(config, source, rank)


class _Rank:
    """run_tp_worker on a thread; `control` and `collective` are rank 0's ends; `exit` what it ended with."""

    def __init__(self, spec: TPWorkerSpec):
        self.control, child_control = multiprocessing.Pipe()
        self.collective, child_collective = multiprocessing.Pipe()
        self.exit = "running"

        def body():
            try:
                run_tp_worker(spec, child_control, child_collective)
                self.exit = "returned"
            except SystemExit as exc:
                self.exit = f"SystemExit({exc.code})"

        self.thread = threading.Thread(target=body, name="tp-rank-1", daemon=True)
        self.thread.start()

    def join(self) -> str:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the rank did not end"
        return self.exit


def _source() -> ArraySource:
    config, weights = random_model(seed=4)
    return ArraySource(config, weights, tokenizer=None)


def test_a_rank_loads_builds_its_runner_and_stops():
    rank = _Rank(_spec(_source()))
    assert rank.control.recv() == Loaded()
    rank.control.send(InitRunner(8, 0, 32, 256))
    assert rank.control.recv() == Ready()
    rank.control.send(Stop())
    assert rank.join() == "returned"


def test_a_shard_that_cannot_load_is_reported_not_raised():
    class Broken:
        config = _source().config

        def shard(self, rank, world_size, xp, dtype):
            raise ValueError(f"model.safetensors: no slice {rank} of {world_size}")

    rank = _Rank(_spec(Broken()))
    assert rank.control.recv() == Failed("ValueError: model.safetensors: no slice 1 of 2")
    assert rank.join() == "returned"


def test_an_unknown_message_ends_the_rank_with_exit_code_1(capsys):
    rank = _Rank(_spec(_source()))
    assert rank.control.recv() == Loaded()
    rank.control.send("dance")
    assert rank.join() == "SystemExit(1)"
    assert "unknown message 'dance'" in capsys.readouterr().err


def test_rank_0_gone_ends_the_rank_quietly(capsys):
    rank = _Rank(_spec(_source()))
    assert rank.control.recv() == Loaded()
    rank.control.close()
    assert rank.join() == "returned"
    assert "Traceback" not in capsys.readouterr().err


def test_cpu_ranks_talk_over_the_collective_pipe():
    mine, theirs = multiprocessing.Pipe()
    comm = _communicator(_spec(_source(), rank=1), theirs)
    assert isinstance(comm, PipeCommunicator) and (comm.rank, comm.world_size, comm.conns) == (1, 2, [theirs])
