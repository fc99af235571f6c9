"""Communicator: the collectives a tensor-parallel rank needs, and a NumPy fake group over threads.

Interface (duck-typed; `Llama` and the runner call only these):
    rank, world_size
    all_reduce(x)            sum x over the ranks, in place; every rank ends with the same values
    all_gather(x) -> [N, *x.shape]   the ranks' x stacked in rank order
    broadcast(x, root=0)     x of `root` copied into every rank's x, in place (small arrays)

`ThreadGroup` runs N ranks as threads of one process over NumPy (tests, CPU): each collective is two
barrier waits around a shared slot per rank. Every rank sums the slots itself in rank order, so the
results are bitwise equal on all ranks, as NCCL's are. `run_ranks(fn, N)` runs `fn(rank, comm)` on N
threads and returns the results in rank order; a failure on one rank breaks the barrier, so the others
stop instead of waiting forever, and the first failure is raised.
The NCCL implementation is offline_paged/tp/tp_nccl.py.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x) -> None: ...

    def all_gather(self, x): ...

    def broadcast(self, x, root: int = 0) -> None: ...


class ThreadGroup:
    """Shared state of N thread ranks: one slot per rank and a barrier (`timeout` seconds)."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.slots: list[Any] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)

    def communicator(self, rank: int) -> ThreadCommunicator:
        return ThreadCommunicator(self, rank)


class ThreadCommunicator:
    """One rank of a `ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int):
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank must be in 0..{group.world_size - 1}, got {rank}")
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def _exchange(self, x) -> list[Any]:
        """Publish a copy of x, wait for every rank, return all slots (valid until `_done`)."""
        self.group.slots[self.rank] = np.array(x, copy=True)
        self.group.barrier.wait()
        return self.group.slots

    def _done(self) -> None:
        self.group.barrier.wait()  # nobody overwrites a slot before every rank has read them all

    def all_reduce(self, x) -> None:
        slots = self._exchange(x)
        total = slots[0].copy()
        for part in slots[1:]:
            total += part
        self._done()
        x[...] = total

    def all_gather(self, x):
        gathered = np.stack(self._exchange(x))  # [N, *x.shape]
        self._done()
        return gathered

    def broadcast(self, x, root: int = 0) -> None:
        value = self._exchange(x)[root].copy()
        self._done()
        x[...] = value


def run_ranks(fn: Callable[[int, ThreadCommunicator], Any], world_size: int, timeout: float = 120.0) -> list[Any]:
    """Run fn(rank, communicator) for every rank on its own thread; results in rank order."""
    group = ThreadGroup(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group.communicator(rank))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append((rank, exc))
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [(r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
    if real:
        rank, exc = real[0]
        raise RuntimeError(f"tensor-parallel rank {rank} failed: {exc!r}") from exc
    return results


class PipeCommunicator:
    """One rank of a CPU group of processes over multiprocessing pipes (a star through rank 0).

    Rank 0 holds one connection per other rank (`conns[r - 1]`); every other rank holds its one
    connection to rank 0. Rank 0 sums in rank order and sends the total back, so all ranks get the
    same values (and the same as `ThreadGroup`). A peer that died shows up as EOFError/OSError on
    the pipe, raised here as a RuntimeError naming the rank."""

    def __init__(self, rank: int, world_size: int, conns: list):
        expected = world_size - 1 if rank == 0 else 1
        if len(conns) != expected:
            raise ValueError(f"rank {rank} of {world_size} needs {expected} connections, got {len(conns)}")
        self.rank, self.world_size, self.conns = rank, world_size, conns

    def _recv(self, index: int):
        try:
            return self.conns[index].recv()
        except (EOFError, OSError) as exc:
            peer = index + 1 if self.rank == 0 else 0
            raise RuntimeError(f"tensor-parallel rank {peer} is gone ({type(exc).__name__})") from None

    def _gather_to_root(self, x) -> list | None:
        """Rank 0: every rank's x in rank order; other ranks: send x, return None."""
        if self.rank != 0:
            self.conns[0].send(np.asarray(x))
            return None
        return [np.asarray(x)] + [self._recv(i) for i in range(self.world_size - 1)]

    def _from_root(self, value):
        if self.rank == 0:
            for conn in self.conns:
                conn.send(value)
            return value
        return self._recv(0)

    def all_reduce(self, x) -> None:
        parts = self._gather_to_root(x)
        total = None
        if parts is not None:
            total = parts[0].copy()
            for part in parts[1:]:
                total += part
        x[...] = self._from_root(total)

    def all_gather(self, x):
        parts = self._gather_to_root(x)
        return self._from_root(None if parts is None else np.stack(parts))  # [N, *x.shape]

    def broadcast(self, x, root: int = 0) -> None:
        if root != 0:
            raise ValueError("PipeCommunicator.broadcast: only root 0 is supported")
        x[...] = self._from_root(np.array(x, copy=True) if self.rank == 0 else None)
