"""A tensor-parallel rank > 0: one process that holds its shard and replays rank 0's steps.

`run_tp_worker(spec, control, collective)` is the `spawn` target. `control` is a duplex pipe to rank 0
carrying the messages of tp_messages.py (the protocol's order is given there); a MirroredStep is replayed
by this rank's runner (ModelRunner.run_mirrored).
`collective` is this rank's pipe to rank 0 for the CPU's PipeCommunicator (None on CUDA: NCCL).
A failure after "loaded" is printed and ends the process; its pipes close, so rank 0 sees the rank gone
(on the CPU at once; NCCL peers may wait on a collective until killed).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from offline_paged.core import gc_pacing
from offline_paged.core.config import EngineConfig
from offline_paged.tp.tp_messages import Failed, InitRunner, Loaded, Profile, Profiled, Ready, Stop
from offline_paged.worker.mirrored_step import MirroredStep


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
        control.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    control.send(Loaded())
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
    with gc_pacing.paced():  # rank 0's step loop is paced; so is this rank's replay of it
        while True:
            message = control.recv()
            if isinstance(message, MirroredStep):
                runner.run_mirrored(message)
            elif isinstance(message, Profile):
                activations = profile_step_memory(model, backend, message.num_tokens, message.num_seqs,
                                                  message.block_size)
                usable = int(backend.free_memory_bytes() * config.gpu_memory_utilization) - activations
                control.send(Profiled(usable))
            elif isinstance(message, InitRunner):
                model.set_max_positions(message.max_model_len)
                runner = ModelRunner(model, backend, message.num_gpu_blocks, message.num_cpu_blocks, config.block_size,
                                     device_sampling=False, cuda_graphs=config.cuda_graphs,
                                     max_model_len=message.max_model_len, max_num_seqs=message.max_num_seqs)
                control.send(Ready())
            elif isinstance(message, Stop):
                return
            else:
                raise RuntimeError(f"tensor-parallel rank {spec.rank}: unknown message {message!r}")
