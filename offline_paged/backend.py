"""Backend: which array module, ops and dtype the model runs on (NumPy on CPU, CuPy on CUDA).

"auto" picks CUDA when `import cupy` works and it sees a device, else the CPU. CUDA pieces are
imported lazily so a CPU-only install never touches them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}


@dataclass(frozen=True, slots=True)
class Backend:
    name: str  # "cpu" | "cuda"
    xp: Any  # numpy or cupy
    ops: Any  # NumpyOps or CudaOps
    dtype: np.dtype  # the model and KV-cache dtype

    def to_host(self, array) -> np.ndarray:
        """Device array -> numpy (a no-op on the CPU)."""
        return array.get() if hasattr(array, "get") else np.asarray(array)

    def int32(self, values) -> Any:
        """A host list/array as an int32 array on the device."""
        return self.xp.asarray(np.asarray(values, dtype=np.int32))

    def free_memory_bytes(self) -> int | None:
        """Free device memory (CUDA only; None on the CPU, where the caller picks a budget): what the
        driver reports free plus what CuPy's pool holds but no array uses (freed activations)."""
        if self.name != "cuda":
            return None
        free, _total = self.xp.cuda.runtime.memGetInfo()
        return int(free) + int(self.xp.get_default_memory_pool().free_bytes())


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def select_backend(device: str = "auto", dtype: str | None = None) -> Backend:
    """Build the Backend for `device` ("auto" | "cpu" | "cuda"); raises ValueError when "cuda" is
    asked for and unavailable, or the dtype does not exist on that backend."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        from offline_paged.models.ops_numpy import NumpyOps

        return Backend("cpu", np, NumpyOps(), _dtype(np, dtype or _DEFAULT_DTYPE["cpu"]))
    if device == "cuda":
        if not cuda_available():
            raise ValueError("device='cuda' needs CuPy and a visible NVIDIA GPU; none found "
                             "(install offline-paged[cuda] or use device='cpu')")
        import cupy

        from offline_paged.cuda.ops_cuda import CudaOps

        return Backend("cuda", cupy, CudaOps(), _dtype(np, dtype or _DEFAULT_DTYPE["cuda"]))
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def _dtype(xp, name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            raise ValueError("dtype='bfloat16' needs the ml_dtypes package") from None
    try:
        return np.dtype(getattr(xp, name))
    except (AttributeError, TypeError):
        raise ValueError(f"unknown dtype {name!r}") from None
