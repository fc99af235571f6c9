"""A tensor-parallel rank > 0: one process that holds its shard and replays rank 0's steps.

`run_tp_worker(spec, control, collective)` is the `spawn` target. Protocol on `control` (a duplex pipe
to rank 0), in order:
    worker -> ("loaded",) once the shard is in memory, or ("failed", message) and exit
    (the communicator is created next: NCCL init is collective, so it waits for every rank)
    rank 0 -> ("profile", num_tokens, num_seqs, block_size)   CUDA only: the profiling forward, in step
    worker -> ("profiled", usable KV bytes on this GPU)
    rank 0 -> ("init", num_gpu_blocks, num_cpu_blocks, max_model_len)
    worker -> ("ready",)
    rank 0 -> ("step", moves, forward)   every launched step (ModelRunner.run_mirrored), no reply
    rank 0 -> ("stop",)
`collective` is this rank's pipe to rank 0 for the CPU's PipeCommunicator (None on CUDA: NCCL).
A failure after "loaded" is printed and ends the process; its pipes close, so rank 0 sees the rank gone
(on the CPU at once; NCCL peers may wait on a collective until killed).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from offline_paged.core.config import EngineConfig


@dataclass(frozen=True)
class TPWorkerSpec:
    config: EngineConfig
    source: Any  # models/tp_source.py: ArraySource | CheckpointSource | DummySource
    rank: int
    nccl_id: Any = None  # NCCL unique id on CUDA; None on the CPU


def run_tp_worker(spec: TPWorkerSpec, control, collective) -> None:
    from offline_paged.tp.tp_nccl import disable_nvls

    disable_nvls()
    try:
        backend, local_config, weights = _load_shard(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        control.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    control.send(("loaded",))
    try:
        _serve(spec, control, collective, backend, local_config, weights)
    except EOFError:
        return  # rank 0 is gone
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None


def _load_shard(spec: TPWorkerSpec):
    from offline_paged.worker.backend import select_backend

    config = spec.config
    if config.device == "cuda":
        import cupy

        cupy.cuda.Device(spec.rank).use()  # before anything allocates
    backend = select_backend(config.device, config.dtype)
    local_config, weights = spec.source.shard(spec.rank, config.tensor_parallel_size, backend.xp, backend.dtype)
    return backend, local_config, weights


def _communicator(spec: TPWorkerSpec, collective):
    world_size = spec.config.tensor_parallel_size
    if spec.nccl_id is not None:
        from offline_paged.tp.tp_nccl import NcclCommunicator

        return NcclCommunicator(spec.nccl_id, spec.rank, world_size)
    from offline_paged.tp.tp_communicator import PipeCommunicator

    return PipeCommunicator(spec.rank, world_size, [collective])


def _serve(spec: TPWorkerSpec, control, collective, backend, local_config, weights) -> None:
    from offline_paged.models.llama import Llama
    from offline_paged.models.tp_shard import TensorParallelShard
    from offline_paged.worker.model_runner import ModelRunner, profile_step_memory

    config = spec.config
    tp = TensorParallelShard(spec.rank, config.tensor_parallel_size, spec.source.config.vocab_size,
                             _communicator(spec, collective))
    model = Llama(local_config, weights, backend.ops, backend.dtype, max_positions=config.max_num_batched_tokens,
                  tp=tp, consume_weights=True)  # a 70B shard is not held twice
    del weights
    runner = None
    while True:
        message = control.recv()
        kind = message[0]
        if kind == "step":
            runner.run_mirrored(*message[1:])
        elif kind == "profile":
            num_tokens, num_seqs, block_size = message[1:]
            activations = profile_step_memory(model, backend, num_tokens, num_seqs, block_size)
            usable = int(backend.free_memory_bytes() * config.gpu_memory_utilization) - activations
            control.send(("profiled", usable))
        elif kind == "init":
            num_gpu_blocks, num_cpu_blocks, max_model_len = message[1:]
            model.set_max_positions(max_model_len)
            runner = ModelRunner(model, backend, num_gpu_blocks, num_cpu_blocks, config.block_size,
                                 device_sampling=False, cuda_graphs=config.cuda_graphs,
                                 max_model_len=max_model_len, max_num_seqs=config.max_num_seqs)
            control.send(("ready",))
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"tensor-parallel rank {spec.rank}: unknown message {kind!r}")
