"""The CPU communicators (tp/tp_communicator.py): ThreadGroup ranks and PipeCommunicator ranks give the
same collectives, bitwise equal on every rank; bad ranks and dead peers are clear errors."""
from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

from offline_paged.tp.tp_communicator import PipeCommunicator, ThreadGroup, run_ranks


def test_a_failing_rank_does_not_hang_the_others():
    def rank_fn(rank, comm):
        if rank == 1:
            raise ValueError("planted")
        comm.all_reduce(np.ones(3))

    with pytest.raises(RuntimeError, match="rank 1 failed.*planted"):
        run_ranks(rank_fn, 2, timeout=30)


def _inputs(world_size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(world_size)]  # one [3, 5] per rank


def _collectives(rank, comm, inputs):
    """all_reduce, all_gather and broadcast of this rank's random input; returns what the rank saw."""
    reduced = inputs[rank].copy()
    comm.all_reduce(reduced)
    gathered = comm.all_gather(inputs[rank])
    broadcast = inputs[rank].copy()
    comm.broadcast(broadcast, root=0)
    return reduced, gathered, broadcast


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_thread_ranks_reduce_gather_and_broadcast(world_size):
    inputs = _inputs(world_size, seed=world_size)
    results = run_ranks(lambda rank, comm: _collectives(rank, comm, inputs), world_size, timeout=30)
    total = inputs[0].copy()
    for x in inputs[1:]:
        total += x  # rank order, as the communicator sums
    for reduced, gathered, broadcast in results:
        np.testing.assert_array_equal(reduced, total)
        np.testing.assert_array_equal(gathered, np.stack(inputs))
        np.testing.assert_array_equal(broadcast, inputs[0])


def test_thread_broadcast_from_a_non_zero_root():
    inputs = _inputs(3, seed=7)

    def rank_fn(rank, comm):
        x = inputs[rank].copy()
        comm.broadcast(x, root=2)
        return x

    for x in run_ranks(rank_fn, 3, timeout=30):
        np.testing.assert_array_equal(x, inputs[2])


def _pipe_ranks(world_size: int, fn) -> list:
    """fn(rank, PipeCommunicator) on a thread per rank, wired as a star through rank 0."""
    pairs = [multiprocessing.Pipe() for _ in range(world_size - 1)]
    comms = [PipeCommunicator(0, world_size, [a for a, _ in pairs])]
    comms += [PipeCommunicator(r, world_size, [pairs[r - 1][1]]) for r in range(1, world_size)]
    results: list = [None] * world_size
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(r, comms[r])))
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipe_ranks_give_the_thread_ranks_results_bitwise(world_size):
    inputs = _inputs(world_size, seed=10 + world_size)
    want = run_ranks(lambda rank, comm: _collectives(rank, comm, inputs), world_size, timeout=30)
    got = _pipe_ranks(world_size, lambda rank, comm: _collectives(rank, comm, inputs))
    for got_rank, want_rank in zip(got, want):
        assert got_rank is not None
        for g, w in zip(got_rank, want_rank):
            np.testing.assert_array_equal(g, w)


def test_bad_ranks_and_sizes_are_refused():
    with pytest.raises(ValueError, match="world_size must be positive"):
        ThreadGroup(0)
    with pytest.raises(ValueError, match=r"rank must be in 0..1, got 2"):
        ThreadGroup(2).communicator(2)
    with pytest.raises(ValueError, match="rank 0 of 3 needs 2 connections, got 1"):
        PipeCommunicator(0, 3, [object()])
    with pytest.raises(ValueError, match="only root 0"):
        PipeCommunicator(1, 2, [object()]).broadcast(np.ones(2), root=1)


def test_a_dead_pipe_peer_is_named():
    mine, theirs = multiprocessing.Pipe()
    theirs.close()
    comm = PipeCommunicator(0, 2, [mine])
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 is gone"):
        comm.all_reduce(np.ones(3))
