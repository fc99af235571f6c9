"""NcclCommunicator: the tensor-parallel collectives over NCCL through CuPy (`cupy.cuda.nccl`).

Every collective is queued on the *current* CuPy stream and returns at once, so it orders with the
kernels around it and is recorded like any kernel when the stream is being captured into a CUDA graph
(the decode graphs capture the forward, all-reduces included). Buffers must be C-contiguous device
arrays of float32, float16, bfloat16 or int32.

NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE` is set to "0" before the communicator is
created, overriding whatever the environment says (it is off on the lent machines for a reason).
"""
from __future__ import annotations

import os

# The NCCL type code of each dtype name (ncclDataType_t); bfloat16 is 9 in every NCCL >= 2.10.
_NCCL_TYPES = {"int32": 2, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_SUM = 0


def disable_nvls() -> None:
    """Keep NVLink multicast off in this process and every process it starts."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def new_unique_id():
    """A fresh NCCL unique id (a picklable tuple) for rank 0 to hand to the other ranks."""
    disable_nvls()
    from cupy.cuda import nccl

    return nccl.get_unique_id()


class NcclCommunicator:
    """One rank of an NCCL group on the current CUDA device. Constructing it is collective: it
    returns when all `world_size` ranks have joined with the same `unique_id`."""

    def __init__(self, unique_id, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        disable_nvls()
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self.rank, self.world_size = rank, world_size
        self._comm = nccl.NcclCommunicator(world_size, unique_id, rank)

    def _check(self, x, what: str) -> int:
        name = x.dtype.name
        if name not in _NCCL_TYPES:
            raise ValueError(f"NcclCommunicator.{what}: dtype {name} is not one of {sorted(_NCCL_TYPES)}")
        if not x.flags.c_contiguous:
            raise ValueError(f"NcclCommunicator.{what}: the buffer must be C-contiguous (shape {x.shape})")
        return _NCCL_TYPES[name]

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def all_reduce(self, x) -> None:
        """Sum x [...] over the ranks, in place, on the current stream."""
        dtype = self._check(x, "all_reduce")
        self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, dtype, _NCCL_SUM, self._stream())

    def all_gather(self, x):
        """[N, *x.shape]: every rank's x in rank order (a new array), on the current stream."""
        dtype = self._check(x, "all_gather")
        out = self._cupy.empty((self.world_size,) + tuple(x.shape), dtype=x.dtype)  # [N, ...]
        self._comm.allGather(x.data.ptr, out.data.ptr, x.size, dtype, self._stream())
        return out

    def broadcast(self, x, root: int = 0) -> None:
        """Root's x into every rank's x, in place, on the current stream."""
        dtype = self._check(x, "broadcast")
        self._comm.broadcast(x.data.ptr, x.data.ptr, x.size, dtype, root, self._stream())

    def close(self) -> None:
        self._comm.destroy()
