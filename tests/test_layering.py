"""Imports point down (STYLE.md rule 2), read from the sources with ast: a new upward import fails here.

The engine core is pure Python (Hypothesis drives it fast anywhere) and ranked: a module imports only
core modules of a lower rank. models/ and cuda/ never import the engine package or the CLI; nothing
below the CLI imports it. KNOWN_UPWARD lists the one upward import the layout issue still has to
remove; anything else fails.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"offline_paged": "offline_paged", "models": "offline_paged.models", "cuda": "offline_paged.cuda",
            "cli": "offline_paged.cli"}
# The engine core, by rank: imports go to strictly lower ranks only.
CORE_RANKS = {
    "allocator": 0, "config": 0, "sampling_params": 0, "sequence": 0,
    "block_manager": 1, "seq_queue": 1, "beam_search": 1,
    "scheduler": 2,
    "output_processor": 3,
}
KNOWN_UPWARD = {("offline_paged.cuda.ops_cuda", "offline_paged.models.attention")}


def _modules() -> dict[str, set[str]]:
    """module -> the offline_paged modules (and third-party top-level names) it imports."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = _imports(ast.parse(path.read_text(encoding="utf-8")), package)
    return found


def _imports(tree: ast.AST, package: str) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (package + (f".{node.module}" if node.module else "")) if node.level else node.module
            names.add(base)
            if node.module is None or base in PACKAGES.values():  # `from . import x` / `from pkg import mod`
                names |= {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


MODULES = _modules()


@pytest.mark.parametrize("core", sorted(CORE_RANKS))
def test_core_is_pure_python_and_imports_only_lower_ranks(core):
    imports = MODULES[f"offline_paged.{core}"]
    third_party = {name.split(".")[0] for name in imports} - {"offline_paged"} - set(sys.stdlib_module_names)
    assert not third_party, f"{core} imports {sorted(third_party)}: the core must stay pure Python"
    for name in imports:
        if not name.startswith("offline_paged."):
            continue
        target = name.split(".")[1]
        assert target in CORE_RANKS, f"{core} imports {name}, which is not part of the engine core"
        assert CORE_RANKS[target] < CORE_RANKS[core], \
            f"{core} (rank {CORE_RANKS[core]}) imports {target} (rank {CORE_RANKS[target]}): upward"


def test_models_and_cuda_never_import_the_engine_package_or_the_cli():
    upward = set()
    for module, imports in MODULES.items():
        if not (_within(module, "offline_paged.models") or _within(module, "offline_paged.cuda")):
            continue
        for name in imports:
            inside_lower = _within(name, "offline_paged.models") or _within(name, "offline_paged.cuda")
            if _within(name, "offline_paged") and not inside_lower:
                upward.add((module, name))
            elif _within(module, "offline_paged.cuda") and _within(name, "offline_paged.models"):
                upward.add((module, name))  # cuda sits below models
    assert upward <= KNOWN_UPWARD, f"new upward imports: {sorted(upward - KNOWN_UPWARD)}"


def test_nothing_below_the_cli_imports_it():
    offenders = sorted(m for m, imports in MODULES.items() if not _within(m, "offline_paged.cli")
                       and any(_within(n, "offline_paged.cli") for n in imports))
    assert not offenders, f"these import the CLI: {offenders}"


def test_the_scan_sees_the_imports_it_checks():
    assert "offline_paged.allocator" in MODULES["offline_paged.block_manager"]
    assert "offline_paged.models.attention" in MODULES["offline_paged.cuda.ops_cuda"]
    assert "offline_paged.cuda.modules" in MODULES["offline_paged.cuda.launchers"]
