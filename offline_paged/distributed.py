"""vLLM's `vllm.distributed` names that offline scripts call between two `LLM`s.

`cleanup_dist_env_and_memory()`: vLLM tears down its process groups and empties the CUDA cache.
Here an `LLM` owns its worker processes (close() stops them), so this only returns memory: Python's
garbage collector runs, then CuPy's memory pools are emptied when CuPy is loaded.
"""
from __future__ import annotations

import gc
import sys


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Collect garbage and release CuPy's cached device and pinned memory (when CuPy is in use)."""
    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    if shutdown_ray and "ray" in sys.modules:
        sys.modules["ray"].shutdown()


__all__ = ["cleanup_dist_env_and_memory"]
