"""Backend: which array module, ops and dtype the model runs on (NumPy on CPU, CuPy on CUDA).

device "auto" picks CUDA when `import cupy` works and it sees a device, else the CPU. CUDA pieces are
imported lazily so a CPU-only install never touches them.

dtype "auto" (or None), as in vLLM: on the CPU float32; on CUDA the checkpoint's own `torch_dtype`
(config.json): bfloat16 stays bfloat16, float16 stays float16, and float32 / float64 checkpoints (or no
torch_dtype, or no config.json: GGUF, random test models) run in float16, which is what vLLM does for
float32 checkpoints. CUDA runs float16 and bfloat16 only (the kernels exist for those two).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}
CUDA_DTYPES = ("float16", "bfloat16")
# A checkpoint's torch_dtype -> what "auto" runs it in on CUDA.
_AUTO_CUDA_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float16", "float64": "float16"}


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

    def total_memory_bytes(self) -> int | None:
        """The device's memory (CUDA only; None on the CPU)."""
        if self.name != "cuda":
            return None
        return int(self.xp.cuda.runtime.memGetInfo()[1])

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


def checkpoint_dtype(source: str | Path | None) -> str | None:
    """The `torch_dtype` (newer transformers write `dtype`) of the HF model directory `source`'s
    config.json, e.g. "bfloat16"; None when `source` is not such a directory (GGUF, a default name,
    a model built in memory) or the config names no dtype. ValueError naming the file and the field
    for a value that is not a string."""
    if source is None:
        return None
    config_path = Path(source) / "config.json"
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not a directory with a readable config: nothing to go on
        return None
    if not isinstance(raw, dict):
        return None
    for field in ("torch_dtype", "dtype"):
        value = raw.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{config_path}: {field} must be a dtype name such as \"bfloat16\", got {value!r}")
        return value.removeprefix("torch.")
    return None


def resolve_dtype(device: str, dtype: str | None, checkpoint: str | None = None,
                  checkpoint_source: str = "the checkpoint") -> str:
    """The dtype name a `device` ("cpu" | "cuda") backend runs: `dtype` when given (not None / "auto"),
    else the rule of "auto" (module docstring) applied to the checkpoint's torch_dtype `checkpoint`.
    ValueError for a checkpoint dtype "auto" cannot map, or a dtype CUDA does not run."""
    if dtype in (None, "auto"):
        if device == "cpu":
            return _DEFAULT_DTYPE["cpu"]
        if checkpoint is None:
            return _DEFAULT_DTYPE["cuda"]
        if checkpoint not in _AUTO_CUDA_DTYPE:
            raise ValueError(f"{checkpoint_source}: torch_dtype {checkpoint!r} has no CUDA dtype for "
                             f"dtype='auto' (auto maps {sorted(_AUTO_CUDA_DTYPE)}); pass dtype= explicitly")
        return _AUTO_CUDA_DTYPE[checkpoint]
    if device == "cuda" and dtype not in CUDA_DTYPES:
        raise ValueError(f"dtype={dtype!r} does not run on CUDA (the kernels exist for {CUDA_DTYPES}); "
                         f"use device='cpu' for {dtype}")
    return dtype


def select_backend(device: str = "auto", dtype: str | None = None, checkpoint: str | None = None,
                   checkpoint_source: str = "the checkpoint") -> Backend:
    """Build the Backend for `device` ("auto" | "cpu" | "cuda") and `dtype` (a name, or None / "auto":
    see the module docstring; `checkpoint` is the model's torch_dtype, e.g. from `checkpoint_dtype`,
    and `checkpoint_source` names where it came from in errors). Raises ValueError when "cuda" is
    asked for and unavailable, or the dtype does not exist on that backend."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        from offline_paged.ops.ops_numpy import NumpyOps

        return Backend("cpu", np, NumpyOps(), _dtype(np, resolve_dtype("cpu", dtype)))
    if device == "cuda":
        name = resolve_dtype("cuda", dtype, checkpoint, checkpoint_source)  # refuses before probing a GPU
        if not cuda_available():
            raise ValueError("device='cuda' needs CuPy and a visible NVIDIA GPU; none found "
                             "(install offline-paged[cuda] or use device='cpu')")
        import cupy

        from offline_paged.ops.ops_cuda import CudaOps

        return Backend("cuda", cupy, CudaOps(), _dtype(np, name))
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")  # what the model and KV cache can be


def _dtype(xp, name: str) -> np.dtype:
    if name not in _DTYPE_NAMES:  # numpy would take many names ("ndarray" gives an object dtype)
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(_DTYPE_NAMES)} or 'auto'")
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
