"""TensorParallelGroup: rank 0's side of a tensor-parallel engine.

Rank 0 is the engine's own process: it runs the scheduler and the block manager and holds shard 0.
The group spawns ranks 1..N-1 (offline_paged/tp/tp_worker.py; `spawn`, one process per GPU, GPU r on
CUDA), hands each a picklable shard source and the NCCL unique id, and afterwards sends every step's
block moves and packed forward inputs to them (`send_step`, the runner's mirror: a MirroredStep) right
before rank 0's own forward. The messages are the typed ones of tp_messages.py. Every rank uses the same block ids, so the KV pools stay in step; per rank a KV block holds
only its Hkv/N heads. Sampling happens on rank 0 only, from the gathered logits.

On CUDA the collectives go over NCCL (offline_paged/tp/tp_nccl.py; NVLink multicast off); on the CPU over
pipes (tp_communicator.PipeCommunicator), which lets the protocol run in CI.
"""
from __future__ import annotations

import multiprocessing
import weakref

from offline_paged.core.config import EngineConfig
from offline_paged.tp.tp_messages import Failed, InitRunner, Loaded, Profile, Profiled, Ready, Stop
from offline_paged.tp.tp_worker import TPWorkerSpec, run_tp_worker
from offline_paged.worker.mirrored_step import MirroredStep

_START_TIMEOUT_S = 1800.0  # a 70B shard loads for minutes


class TensorParallelGroup:
    """Spawns the other ranks and loads shard 0. After construction: `local_config`, `weights` (shard
    0's, for rank 0's Llama; drop them once uploaded) and `shard` (a TensorParallelShard with rank 0's
    communicator). Raises ValueError for a split that does not divide or too few GPUs, RuntimeError
    when another rank fails to start (with its message)."""

    def __init__(self, config: EngineConfig, source, backend) -> None:
        from offline_paged.models.tp_shard import TensorParallelShard, check_divisible
        from offline_paged.tp.tp_nccl import disable_nvls

        world_size = config.tensor_parallel_size
        check_divisible(source.config, world_size)
        on_cuda = backend.name == "cuda"
        if on_cuda:
            num_gpus = backend.xp.cuda.runtime.getDeviceCount()
            if num_gpus < world_size:
                raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; "
                                 f"{num_gpus} visible")
        disable_nvls()  # inherited by the spawned ranks
        worker_config = _worker_config(config, backend.name)
        nccl_id = None
        if on_cuda:
            from offline_paged.tp.tp_nccl import new_unique_id

            nccl_id = new_unique_id()
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self._controls, self._processes, collectives = [], [], []
        for rank in range(1, world_size):
            control, child_control = context.Pipe()
            collective, child_collective = (None, None) if on_cuda else context.Pipe()
            process = context.Process(target=run_tp_worker, name=f"offline-paged-tp-rank-{rank}", daemon=True,
                                      args=(TPWorkerSpec(worker_config, source, rank, nccl_id), child_control,
                                            child_collective))
            process.start()
            child_control.close()
            if child_collective is not None:
                child_collective.close()
                collectives.append(collective)
            self._controls.append(control)
            self._processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self._controls, self._processes)
        self.local_config, self.weights = source.shard(0, world_size, backend.xp, backend.dtype)
        self._expect(Loaded)
        if on_cuda:
            from offline_paged.tp.tp_nccl import NcclCommunicator

            communicator = NcclCommunicator(nccl_id, 0, world_size)
        else:
            from offline_paged.tp.tp_communicator import PipeCommunicator

            communicator = PipeCommunicator(0, world_size, collectives)
        self.shard = TensorParallelShard(0, world_size, source.config.vocab_size, communicator)

    # ----------------------------------------------------------------- set-up
    def start_profile(self, num_tokens: int, num_seqs: int, block_size: int) -> None:
        """The other ranks run the same profiling forward as rank 0 (it has collectives)."""
        self._send_all(Profile(num_tokens, num_seqs, block_size))

    def finish_profile(self) -> int:
        """The smallest usable KV bytes any other rank reported."""
        return min(reply.usable_kv_bytes for reply in self._expect(Profiled))

    def init_runners(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int, max_num_seqs: int) -> None:
        """The other ranks build their runners and KV pools (same block counts and batch limit as rank 0)."""
        self._send_all(InitRunner(num_gpu_blocks, num_cpu_blocks, max_model_len, max_num_seqs))

    def wait_ready(self) -> None:
        self._expect(Ready)

    # ----------------------------------------------------------------- steps
    def send_step(self, step: MirroredStep) -> None:
        """ModelRunner's mirror: this step's block moves and forward inputs to every other rank."""
        self._send_all(step)

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        self._finalizer()

    # ----------------------------------------------------------------- pipes
    def _send_all(self, message) -> None:
        for rank, control in enumerate(self._controls, start=1):
            try:
                control.send(message)
            except OSError:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone "
                                   f"(exit code {self._processes[rank - 1].exitcode})") from None

    def _expect(self, reply_type: type) -> list:
        """One reply of `reply_type` (a tp_messages class) from every other rank; RuntimeError naming a rank
        that failed or died."""
        kind = reply_type.kind
        replies = []
        for rank, (control, process) in enumerate(zip(self._controls, self._processes), start=1):
            waited = 0.0
            while not control.poll(1.0):
                waited += 1.0
                if not process.is_alive() or waited > _START_TIMEOUT_S:
                    raise RuntimeError(f"tensor-parallel rank {rank} stopped before {kind!r} "
                                       f"(exit code {process.exitcode})")
            try:
                reply = control.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code {process.exitcode})") from None
            if isinstance(reply, Failed):
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {reply.message}")
            if not isinstance(reply, reply_type):
                got = getattr(reply, "kind", reply)
                raise RuntimeError(f"tensor-parallel rank {rank}: expected {kind!r}, got {got!r}")
            replies.append(reply)
        return replies


def _worker_config(config: EngineConfig, device: str) -> EngineConfig:
    """The config the other ranks run with: the device resolved (rank 0 chose it)."""
    import dataclasses

    return dataclasses.replace(config, device=device)


def _stop(controls, processes) -> None:
    for control in controls:
        try:
            control.send(Stop())
        except OSError:
            pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
    for control in controls:
        control.close()
