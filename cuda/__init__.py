"""offline_paged.cuda: CUDA C sources for CuPy RawModules, their typed launchers and CudaOps.

Nothing here imports cupy at package import time, so a CPU-only install can import the package.

When Python runs from the repository root, this directory is also importable as a top-level `cuda`,
which shadows NVIDIA's `cuda` namespace package (cuda.pathfinder, cuda.bindings) that CuPy 14 imports.
extend_path makes such a shadowing import still find NVIDIA's portions; as offline_paged.cuda it is a no-op.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
