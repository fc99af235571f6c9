"""The messages of the tensor-parallel control protocol between rank 0 (tp_group.py) and each other rank
(tp_worker.py), in the order they flow on a rank's control pipe:

    rank -> Loaded()                            once its shard is in memory, or Failed(message) and exit
    (the communicator is created next: NCCL init is collective, so it waits for every rank)
    0 -> Profile(num_tokens, num_seqs, block_size)   CUDA only: the profiling forward, in step with rank 0
    rank -> Profiled(usable_kv_bytes)
    0 -> InitRunner(num_gpu_blocks, num_cpu_blocks, max_model_len, max_num_seqs)
    rank -> Ready()
    0 -> MirroredStep(moves, rows_diff, forward)    every launched step (worker/mirrored_step.py), no reply
    0 -> Stop()

A reply's `kind` names it in rank 0's errors ("expected 'ready', got 'loaded'").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(slots=True, frozen=True)
class Loaded:
    kind: ClassVar[str] = "loaded"


@dataclass(slots=True, frozen=True)
class Failed:
    """A rank could not load its shard; `message` says why (ExceptionType: text)."""

    kind: ClassVar[str] = "failed"
    message: str


@dataclass(slots=True, frozen=True)
class Profile:
    """Run the profiling forward of `num_tokens` tokens over `num_seqs` sequences (it has collectives)."""

    num_tokens: int
    num_seqs: int
    block_size: int


@dataclass(slots=True, frozen=True)
class Profiled:
    kind: ClassVar[str] = "profiled"
    usable_kv_bytes: int  # device memory this rank can give the KV pool


@dataclass(slots=True, frozen=True)
class InitRunner:
    """Build the runner and the KV pools, with rank 0's block counts and max_num_seqs (the engine's, which
    may be below the config's: fit_max_num_seqs)."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    max_num_seqs: int


@dataclass(slots=True, frozen=True)
class Ready:
    kind: ClassVar[str] = "ready"


@dataclass(slots=True, frozen=True)
class Stop:
    pass
