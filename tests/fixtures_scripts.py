"""Test helper: load one of the repository's scripts (benchmarks/, scripts/) as a module, as running it
with `python PATH` would, so its functions can be called in the test's process."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The script at REPO / relative_path (e.g. "benchmarks/profile_host.py"), executed as a module named
    after its file; registered in sys.modules first, where dataclasses look their module up."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
