"""Imports point down (STYLE.md rule 2), read from the sources with ast: a new upward import fails here.

The package is a stack of layers, one subpackage each (top first): cli, the public API (offline_paged
and offline_paged.entrypoints), dp, benchmark, job, the engine (offline_paged.engine), its request processor,
executor (the seam between the engine and the workers), tp (tensor parallel ranks, when present), worker (the runner), core (the engine core), models, ops (NumPy ops and the CUDA launchers). A module imports
its own layer or lower ones only. Inside the core, the pure-Python modules are ranked as well. The
top-level cuda/ holds CUDA C sources only (no Python can shadow NVIDIA's `cuda` from the repo root).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject's package-dir).
FOLDERS = {"offline_paged": "offline_paged", "models": "offline_paged.models", "cli": "offline_paged.cli"}
# Top first; a module belongs to the longest layer name it starts with.
LAYERS = ["offline_paged.cli", "offline_paged", "offline_paged.entrypoints", "offline_paged.dp",
          "offline_paged.benchmark", "offline_paged.job", "offline_paged.engine", "offline_paged.request_processor",
          "offline_paged.executor", "offline_paged.tp", "offline_paged.worker", "offline_paged.core",
          "offline_paged.models", "offline_paged.ops"]
RANK = {layer: len(LAYERS) - i for i, layer in enumerate(LAYERS)}
RANK["offline_paged.entrypoints"] = RANK["offline_paged"]  # the package root re-exports the entry points
# vLLM's module paths (offline_paged.sampling_params, .outputs, ...) re-export the public API
VLLM_PATHS = ("sampling_params", "pooling_params", "inputs", "outputs", "lora", "distributed")
RANK.update({f"offline_paged.{name}": RANK["offline_paged"] for name in VLLM_PATHS})
# the public paths of the optional integrations re-export them (entrypoints/lm_eval.py, job/ray.py)
RANK.update({f"offline_paged.{name}": RANK["offline_paged"] for name in ("lm_eval", "ray")})
# The pure-Python engine core, by rank: imports go to strictly lower ranks only.
CORE_RANKS = {
    "structured_outputs": -1,
    "allocator": 0, "config": 0, "sampling_params": 0, "sequence": 0, "outputs": 0,
    "block_manager": 1, "seq_queue": 1, "beam_search": 1, "beam_search_params": 1, "engine_stats": 1,
    "scheduler": 2,
    "output_processor": 3,
}
# Core modules that may also use the model layer's text utilities.
CORE_USING_MODELS = {"stop_checker": {"offline_paged.models.detokenizer"}}


def _module_name(path: Path, folder: str) -> str:
    parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([FOLDERS[folder], *parts])


def _modules() -> dict[str, set[str]]:
    """module -> the modules (and third-party top-level names) it imports, anywhere in its body."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = _module_name(path, folder)
            package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
            found[name] = _imports(ast.parse(path.read_text(encoding="utf-8")), package)
    return found


def _imports(tree: ast.AST, package: str) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def _is_module(name: str) -> bool:
    """Whether `name` (offline_paged.x.y) is a module or package of this repo."""
    parts = name.split(".")
    for folder, package in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1])):
        head = package.split(".")
        if parts[:len(head)] == head:
            rest = REPO.joinpath(folder, *parts[len(head):])
            return rest.with_suffix(".py").is_file() or (rest / "__init__.py").is_file()
    return False


def _layer(name: str) -> str:
    return max((layer for layer in LAYERS if name == layer or name.startswith(layer + ".")), key=len)


def _upward(module: str, imports: set[str]) -> set[tuple[str, str]]:
    """The (module, import) pairs of `imports` that point to a higher layer than `module`'s."""
    mine = RANK[_layer(module)]
    return {(module, name) for name in imports
            if (name == "offline_paged" or name.startswith("offline_paged.")) and RANK[_layer(name)] > mine}


MODULES = _modules()


def test_every_module_sits_in_a_layer():
    loose = sorted(m for m in MODULES if m.count(".") == 1 and m not in RANK)
    assert not loose, f"modules or subpackages directly in offline_paged/ outside LAYERS: {loose}"


def test_imports_point_down_between_layers():
    upward = set().union(*(_upward(module, imports) for module, imports in MODULES.items()))
    assert not upward, "upward imports:\n" + "\n".join(f"  {m} -> {n}" for m, n in sorted(upward))


def test_every_internal_import_names_an_existing_module():
    missing = sorted((m, n) for m, imports in MODULES.items() for n in imports
                     if n.startswith("offline_paged.") and _layer(n) != n and not _is_module(n)
                     and not _is_module(n.rsplit(".", 1)[0]))
    assert not missing, f"imports of modules that do not exist: {missing}"


@pytest.mark.parametrize("core", sorted(CORE_RANKS))
def test_core_is_pure_python_and_imports_only_lower_ranks(core):
    imports = MODULES[f"offline_paged.core.{core}"]
    third_party = {name.split(".")[0] for name in imports} - {"offline_paged"} - set(sys.stdlib_module_names)
    assert not third_party, f"{core} imports {sorted(third_party)}: the core must stay pure Python"
    for name in imports:
        if not name.startswith("offline_paged."):
            continue
        assert name.startswith("offline_paged.core."), f"{core} imports {name}, which is not part of the core"
        target = name.split(".")[2]
        assert target in CORE_RANKS, f"{core} imports {name}, which is not ranked in CORE_RANKS"
        assert CORE_RANKS[target] < CORE_RANKS[core], \
            f"{core} (rank {CORE_RANKS[core]}) imports {target} (rank {CORE_RANKS[target]}): upward"


def test_the_rest_of_the_core_uses_only_the_core_and_named_model_utilities():
    for module, imports in MODULES.items():
        stem = module.rsplit(".", 1)[-1]
        if _layer(module) != "offline_paged.core" or stem in CORE_RANKS or module == "offline_paged.core":
            continue
        outside = {n for n in imports if n.startswith("offline_paged.") and not n.startswith("offline_paged.core")}
        assert outside <= CORE_USING_MODELS.get(stem, set()), f"{module} imports {sorted(outside)}"


def test_numpy_ops_and_the_kernel_loader_import_no_cupy_at_module_level():
    for stem in ("ops_numpy", "attention", "attention_fast", "kernel_modules"):
        tree = ast.parse((REPO / "offline_paged" / "ops" / f"{stem}.py").read_text(encoding="utf-8"))
        top = _imports(ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                                  type_ignores=[]), "offline_paged.ops")
        assert not any(n.split(".")[0] == "cupy" for n in top), f"ops/{stem}.py imports cupy at import time"


def test_the_cuda_folder_holds_only_cuda_sources():
    stray = sorted(p.name for p in (REPO / "cuda").iterdir() if p.suffix not in {".cu", ".cuh"}
                   and p.name != "__pycache__")
    assert not stray, f"cuda/ must hold CUDA C sources only (it installs as offline_paged.kernels): {stray}"


def test_nothing_below_the_cli_imports_it():
    offenders = sorted(m for m, imports in MODULES.items() if _layer(m) != "offline_paged.cli"
                       and any(_layer(n) == "offline_paged.cli" for n in imports if n.startswith("offline_paged")))
    assert not offenders, f"these import the CLI: {offenders}"


def test_the_engine_reaches_the_workers_only_through_the_executor():
    """engine.py knows no tensor parallelism: the tp layer is imported by the executor, never above it."""
    assert "offline_paged.executor.executor" in MODULES["offline_paged.engine"]
    above = [m for m in MODULES if RANK[_layer(m)] > RANK["offline_paged.executor"]]
    offenders = sorted((m, n) for m in above for n in MODULES[m]
                       if n.startswith("offline_paged.") and _layer(n) == "offline_paged.tp")
    assert not offenders, f"tensor parallelism reached above the executor: {offenders}"


def test_the_scan_sees_the_imports_it_checks():
    assert "offline_paged.core.allocator" in MODULES["offline_paged.core.block_manager"]
    assert "offline_paged.ops.attention" in MODULES["offline_paged.ops.ops_cuda"]
    assert "offline_paged.ops.kernel_modules" in MODULES["offline_paged.ops.launchers"]
    assert "offline_paged.ops.attention" in MODULES["offline_paged.models.llama"]
    assert "offline_paged.ops.sampling_launcher" in MODULES["offline_paged.worker.gpu_sampler"]


@pytest.mark.parametrize("module, source", [
    ("offline_paged.ops.swap", "from offline_paged.models.llama import Llama"),
    ("offline_paged.models.llama", "def f():\n    from offline_paged.worker import sampler"),
    ("offline_paged.core.scheduler", "import offline_paged.engine"),
    ("offline_paged.executor.local_executor", "from offline_paged.engine import LLMEngine"),
    ("offline_paged.tp.tp_group", "from offline_paged.executor.executor import Executor"),
    ("offline_paged.worker.model_runner", "from offline_paged.executor import tp_executor"),
    ("offline_paged.job.job_input", "from offline_paged.benchmark.bench import warm_up"),
    ("offline_paged.models.loader", "from ..entrypoints.llm import LLM"),
])
def test_a_planted_upward_import_is_caught(module, source):
    imports = _imports(ast.parse(source), module.rsplit(".", 1)[0])
    assert _upward(module, imports), f"{source!r} in {module} was not seen as upward"


def test_a_downward_import_is_not_flagged():
    imports = _imports(ast.parse("from offline_paged.ops.attention import AttentionMetadata"), "offline_paged.worker")
    assert not _upward("offline_paged.worker.model_runner", imports)
