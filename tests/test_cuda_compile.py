"""Every cuda/*.cu source compiles for sm_90 with nvcc (CPU-only: surfaces syntax errors in CI)."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"  # the .cu sources (offline_paged.kernels)
OPS_DIR = Path(__file__).resolve().parents[1] / "offline_paged" / "ops"  # their launchers
SOURCES = sorted(CUDA_DIR.glob("*.cu"))

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc is not on PATH, so the .cu sources cannot be compile-checked")


def test_there_are_sources():
    assert {p.name for p in SOURCES} >= {"attention.cu", "cache.cu", "layer.cu"}


@needs_nvcc
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_source_compiles_for_sm90(source, tmp_path):
    result = subprocess.run(["nvcc", "-arch=sm_90", "--std=c++17", "-c", str(source), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{source.name} does not compile:\n{result.stderr}"


def _launcher_modules() -> list[Path]:
    """The launcher modules: every offline_paged/ops/*.py that imports `kernel` from kernel_modules."""
    found = []
    for path in sorted(OPS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.ImportFrom) and node.module == "offline_paged.ops.kernel_modules"
               and node.level == 0
               and any(alias.name == "kernel" for alias in node.names) for node in ast.walk(tree)):
            found.append(path)
    return found


def _declared_and_called(path: Path) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(KERNELS as the module declares it, the (source, name) pairs of its _kernel calls whose
    arguments are literals or module-level string constants)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants, declared = {}, None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "KERNELS":
                declared = set(ast.literal_eval(node.value))
            elif isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                constants[name] = node.value.value
    assert declared, f"{path.name} launches kernels but declares no KERNELS"

    def value(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        return constants.get(arg.id) if isinstance(arg, ast.Name) else None

    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_kernel":
            source, name = (value(a) for a in node.args[:2])
            if source is not None and name is not None:
                called.add((source, name))
    return declared, called


def test_launchers_are_found_and_call_only_declared_kernels():
    modules = _launcher_modules()
    assert {p.name for p in modules} >= {"launchers.py", "sampling_launcher.py"}
    for path in modules:
        declared, called = _declared_and_called(path)
        assert called, f"{path.name}: no literal _kernel calls found (is the scan still right?)"
        assert called <= declared, f"{path.name} launches undeclared kernels: {sorted(called - declared)}"


@needs_nvcc
def test_every_declared_kernel_is_defined_and_every_entry_point_is_launched(tmp_path):
    """KERNELS of every launcher module exist as extern "C" entry points in the compiled PTX, and
    every entry point of a launched source is declared by some launcher (no orphaned kernels)."""
    wanted = set().union(*(_declared_and_called(p)[0] for p in _launcher_modules()))
    entries: dict[str, set[str]] = {}
    for source in {name for name, _ in wanted}:
        ptx = tmp_path / (source + ".ptx")
        subprocess.run(["nvcc", "-arch=sm_90", "--std=c++17", "--ptx", str(CUDA_DIR / source), "-o", str(ptx)],
                       check=True, capture_output=True, timeout=300)
        entries[source] = set(re.findall(r"\.entry (\w+)\(", ptx.read_text(encoding="utf-8")))
    missing = sorted((s, n) for s, n in wanted if n not in entries[s])
    assert not missing, f"launchers declare kernels that the sources do not define: {missing}"
    orphans = sorted((s, n) for s, names in entries.items() for n in names if (s, n) not in wanted)
    assert not orphans, f"kernels no launcher declares: {orphans}"


# CuPy compiles with NVRTC, which has no host C library headers: names that nvcc finds through math.h or
# cfloat are undefined there (a kernel using INFINITY compiled with nvcc here and failed on the device).
NVRTC_UNDEFINED = ("INFINITY", "NAN", "FLT_MAX", "FLT_MIN", "DBL_MAX", "DBL_MIN", "INT_MAX", "INT_MIN", "M_PI",
                   "HUGE_VAL", "HUGE_VALF")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_source_uses_no_name_nvrtc_lacks(source):
    from offline_paged.ops.kernel_modules import read_source

    code = re.sub(r"//[^\n]*", "", read_source(source.name))  # what NVRTC gets; comments may name them
    used = sorted({name for name in NVRTC_UNDEFINED if re.search(rf"\b{name}\b", code)})
    assert not used, f"{source.name} uses {used}: undefined under NVRTC (spell the bits: __int_as_float(0x7f800000))"
    includes = re.findall(r"#include\s*[<\"]([^>\"]+)", code)
    assert set(includes) <= {"cuda_fp16.h"}, f"{source.name} includes {includes}: only cuda_fp16.h is known to NVRTC here"


def _ptx_entries(source: Path, tmp_path) -> dict[str, str]:
    """{entry point: its PTX text} of one source compiled for sm_90."""
    ptx = tmp_path / (source.name + ".ptx")
    subprocess.run(["nvcc", "-arch=sm_90", "--std=c++17", "--ptx", str(source), "-o", str(ptx)],
                   check=True, capture_output=True, timeout=300)
    parts = re.split(r"(?=\.visible \.entry )", ptx.read_text(encoding="utf-8"))[1:]
    return {re.match(r"\.visible \.entry (\w+)", part).group(1): part for part in parts}


@needs_nvcc
def test_layer_kernels_have_16_byte_paths_and_no_64_bit_division(tmp_path):
    """The elementwise layer kernels move 8 elements per load/store on their vector paths (the
    bandwidth fix), and silu_mul divides no 64-bit index per element."""
    entries = _ptx_entries(CUDA_DIR / "layer.cu", tmp_path)
    for suffix in ("f16", "bf16"):
        for name in ("rms_norm", "silu_mul", "rope_same_cache", "rope_f32_cache", "rope_write_kv_same_cache",
                     "rope_write_kv_f32_cache", "rope_write_kv_fp8_same_cache", "rope_write_kv_fp8_f32_cache"):
            body = entries[f"{name}_{suffix}"]
            assert re.search(r"ld\.global(\.nc)?\.v4\.", body), f"{name}_{suffix}: no 16-byte load in its PTX"
            assert re.search(r"st(\.global)?\.v4\.", body), f"{name}_{suffix}: no 16-byte store in its PTX"
        assert not re.search(r"(div|rem)\.[su]64", entries[f"silu_mul_{suffix}"]), \
            f"silu_mul_{suffix} divides a 64-bit index"
        assert ".local" not in entries[f"rms_norm_{suffix}"], f"rms_norm_{suffix}: its held row spilled to local memory"


def _python_constant(path: Path, name: str) -> int:
    """The integer a module assigns to `name` at top level (read without importing: launchers needs cupy)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} assigns no {name}")


@pytest.mark.parametrize("name", ["DECODE_RING_STAGES", "DECODE_RING_STAGES_FP8", "PREFILL_RING_STAGES",
                                  "DECODE_RING_STAGES_DENSE", "FP8_WIDE_DECODE", "FP8_DECODE_D128_RING"])
def test_launcher_constants_match_the_kernel(name):
    """The launcher sizes the cp.async rings' shared memory from its copies of the kernel's stage counts."""
    found = re.search(rf"constexpr int {name} = (\d+);", (CUDA_DIR / "attention.cu").read_text(encoding="utf-8"))
    assert found, f"attention.cu defines no constexpr int {name}"
    assert int(found.group(1)) == _python_constant(OPS_DIR / "launchers.py", name)


def test_race_split_matches_the_kernel():
    """race_logits sizes its grid and partials from its copy of sampling.cu's RACE_SPLIT (blocks per row)."""
    found = re.search(r"constexpr int RACE_SPLIT = (\d+);", (CUDA_DIR / "sampling.cu").read_text(encoding="utf-8"))
    assert found, "sampling.cu defines no constexpr int RACE_SPLIT"
    assert int(found.group(1)) == _python_constant(OPS_DIR / "sampling_launcher.py", "RACE_SPLIT")


@pytest.mark.parametrize("kernel_name,python_name", [("PREFILL_STAGES", "PREFILL_STAGES"),
                                                     ("TILE_ROWS", "PREFILL_TILE_ROWS"),
                                                     ("TILE_KEYS", "PREFILL_TILE_KEYS"),
                                                     ("THREADS", "PREFILL_THREADS")])
def test_prefill_launcher_constants_match_the_kernel(kernel_name, python_name):
    """The launcher sizes prefill_attention.cu's grid, block and shared memory from copies of its constants."""
    source = (CUDA_DIR / "prefill_attention.cu").read_text(encoding="utf-8")
    values = {name: int(value) for name, value in re.findall(r"constexpr int (\w+) = (\d+);", source)}
    values["TILE_ROWS"] = values["WARPS"] * values["WARP_ROWS"]  # defined as their product
    values["THREADS"] = 32 * values["WARPS"]
    assert values[kernel_name] == _python_constant(OPS_DIR / "launchers.py", python_name)


@needs_nvcc
def test_prefill_kernels_run_on_tensor_cores_from_shared_memory(tmp_path):
    """Every prefill entry point takes K/V through cp.async into shared memory, feeds the tensor cores with
    ldmatrix (transposed for V) and mma.sync, and exponentiates on the SFU (ex2.approx): the FlashAttention-2
    data path, not a fallback that still computes the right numbers slowly."""
    entries = _ptx_entries(CUDA_DIR / "prefill_attention.cu", tmp_path)
    names = {f"prefill_attention_d{d}_{s}{c}" for d in (64, 128) for s in ("f16", "bf16") for c in ("", "_fp8")}
    assert set(entries) == names
    for name, body in entries.items():
        # An FP8 cache's tiles reach shared memory through registers (converted to 16 bits on the way).
        staging = "st.shared.v4.b32" if name.endswith("_fp8") else "cp.async.cg.shared.global"
        for needle in (staging, "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                       "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "mma.sync.aligned.m16n8k16.row.col.f32",
                       "ex2.approx", "bar.sync"):
            assert needle in body, f"{name}: no {needle} in its PTX"


@needs_nvcc
def test_prefill_kernel_at_head_dim_128_keeps_everything_in_registers(tmp_path):
    """At D = 128 the kernel runs one 256-thread CTA per SM and may use 255 registers: nothing may spill
    (a spill in the key loop costs more than the occupancy it would buy)."""
    result = subprocess.run(["nvcc", "-arch=sm_90", "--std=c++17", "-c", "-Xptxas", "-v",
                             str(CUDA_DIR / "prefill_attention.cu"), "-o", str(tmp_path / "p.o")],
                            capture_output=True, text=True, timeout=300, check=True)
    blocks = re.split(r"Compiling entry function '", result.stderr)[1:]
    spills = {b.split("'")[0]: re.search(r"(\d+) bytes spill stores", b).group(1) for b in blocks}
    assert {n for n in spills if "d128" in n} == {f"prefill_attention_d128_{s}{c}" for s in ("f16", "bf16")
                                                  for c in ("", "_fp8")}
    assert all(spills[n] == "0" for n in spills if "d128" in n), spills
