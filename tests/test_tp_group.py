"""TensorParallelGroup's control protocol on rank 0 (tp/tp_group.py), over real pipes to fake ranks:
replies in rank order, failures and dead or confused ranks named, stop sent on close. The full group
with spawned CPU ranks runs in test_tensor_parallel_engine.py."""
from __future__ import annotations

import dataclasses
import multiprocessing
import weakref

import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.tp import tp_group
from offline_paged.tp.tp_group import TensorParallelGroup
from offline_paged.tp.tp_messages import Failed, InitRunner, Loaded, Profile, Profiled, Ready, Stop


class _FakeProcess:
    def __init__(self, alive: bool = True, exitcode=None):
        self.alive, self.exitcode, self.joined, self.terminated = alive, exitcode, False, False

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        self.joined = True

    def terminate(self) -> None:
        self.terminated, self.alive = True, False


def _group(num_other_ranks: int, processes=None):
    """A group whose ranks 1..N are the far ends of pipes (returned), without spawning anything."""
    group = object.__new__(TensorParallelGroup)
    pipes = [multiprocessing.Pipe() for _ in range(num_other_ranks)]
    group.world_size = num_other_ranks + 1
    group._controls = [mine for mine, _ in pipes]
    group._processes = processes or [_FakeProcess() for _ in pipes]
    group._finalizer = weakref.finalize(group, tp_group._stop, group._controls, group._processes)
    return group, [theirs for _, theirs in pipes]


def test_messages_reach_every_rank_and_the_smallest_profile_wins():
    group, ranks = _group(3)
    group.start_profile(64, 4, 16)
    assert [r.recv() for r in ranks] == [Profile(64, 4, 16)] * 3
    for r, usable in zip(ranks, [7_000, 5_000, 9_000]):
        r.send(Profiled(usable))
    assert group.finish_profile() == 5_000
    group.init_runners(10, 2, 128, 64)
    group.send_step("a MirroredStep")
    assert [r.recv() for r in ranks] == [InitRunner(10, 2, 128, 64)] * 3
    assert [r.recv() for r in ranks] == ["a MirroredStep"] * 3
    for r in ranks:
        r.send(Ready())
    group.wait_ready()
    group.close()


def test_a_rank_that_failed_is_named_with_its_message():
    group, ranks = _group(2)
    ranks[0].send(Loaded())
    ranks[1].send(Failed("ValueError: shard 1 of model.safetensors is missing"))
    with pytest.raises(RuntimeError, match="rank 2 failed: ValueError: shard 1 of model.safetensors is missing"):
        group._expect(Loaded)


def test_an_unexpected_reply_is_named():
    group, ranks = _group(1)
    ranks[0].send(Ready())
    with pytest.raises(RuntimeError, match="rank 1: expected 'loaded', got 'ready'"):
        group._expect(Loaded)


def test_a_rank_that_died_silently_is_named_with_its_exit_code():
    group, _ranks = _group(1, processes=[_FakeProcess(alive=False, exitcode=-9)])
    with pytest.raises(RuntimeError, match=r"rank 1 stopped before 'ready' \(exit code -9\)"):
        group._expect(Ready)


def test_sending_to_a_rank_whose_pipe_closed_is_named():
    group, _ranks = _group(2, processes=[_FakeProcess(), _FakeProcess(alive=False, exitcode=1)])
    group._controls[1].close()
    with pytest.raises(RuntimeError, match=r"rank 2 is gone \(exit code 1\)"):
        group.send_step(None)


def test_close_sends_stop_joins_terminates_the_stuck_and_is_idempotent():
    stuck, done = _FakeProcess(alive=True), _FakeProcess(alive=False, exitcode=0)
    group, ranks = _group(2, processes=[stuck, done])
    group.close()
    group.close()
    assert ranks[0].recv() == Stop() and ranks[1].recv() == Stop()
    with pytest.raises(EOFError):  # sent once, then rank 0's end is closed
        ranks[0].recv()
    assert stuck.joined and stuck.terminated and done.joined and not done.terminated


def test_worker_config_only_resolves_the_device():
    config = EngineConfig(device="auto", tensor_parallel_size=2, num_kv_blocks=8)
    worker = tp_group._worker_config(config, "cpu")
    assert worker.device == "cpu"
    assert dataclasses.replace(worker, device=config.device) == config
