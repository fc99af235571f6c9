"""Kernel benchmark (GPU): is there a faster cuBLASLt FP8 algorithm for the decode GEMMs than TunedGemm's pick?

TunedGemm times the candidates cuBLASLt's heuristic lists (ops/cublaslt.NUM_CANDIDATES, 16) and keeps the fastest;
at the 8B shape's decode rows those picks read their weights at ~50-64% of the copy bandwidth (NOTES, session 56),
the largest gap left in issue 25's FP8 decode step. This script asks what a wider search would find, per projection
and row count, in one run:
  - "first": the heuristic's first candidate (what the eager steps' untuned TunedGemm runs);
  - "heur16" / "heur64": the fastest of the heuristic's first 16 / 64 candidates (TunedGemm's search, and the
    NUM_CANDIDATES = 64 knob);
  - "enum": the fastest of every configuration cuBLASLt accepts (cublasLtMatmulAlgoCheck) among the heuristic's 64
    candidates with each tile their algorithm lists (cublasLtMatmulAlgoCapGetAttribute) x split-K 1 / 2 / 4 / 8:
    timed once quickly, the best QUICK_KEEP timed again as TunedGemm does (up to
    ENUM_MAX_ROWS rows; a prefill-sized product, e.g. --rows 7554, times the heuristic's candidates only).
Each time is the median of graph replays over enough weight copies that they miss in L2, as a decode step's
weights do; "w of copy" is the weight bytes over that time against the device-to-device copy bandwidth.
The products are FP8 e4m3 x e4m3 into bfloat16 sums with fast accumulation, as the FP8 model runs them.

    PYTHONPATH=benchmarks python3 benchmarks/bench_fp8_gemm_search.py [--rows 144 256 64] [--presets llama-3.1-8b]

Ran in session 60 on an H100 (results/2026-12-08_h100_s60_fp8_gemm_search.txt): the enumeration finds down at 144
rows 13% faster than TunedGemm's pick (tile 317), the other decode products 0-4%.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools

import cupy
import numpy as np
from bench_gemm import projections
from bench_kernels import copy_bandwidth_gbs, graph_ms

from offline_paged.ops import cublaslt
from offline_paged.ops.cublaslt import TunedGemm, _Algo, _Heuristic, _Plan, check_fp8_args
from offline_paged.ops.launchers import BFLOAT16, fp8_padded

# cublasLt.h's enums (CUDA 12 / 13)
_CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_STAGES_ID = 1, 2, 6  # cublasLtMatmulAlgoConfigAttributes_t
_CAP_TILE_IDS = 6  # cublasLtMatmulAlgoCapAttributes_t
SPLITS_K = (1, 2, 4, 8)
QUICK_KEEP = 12  # configurations timed again after the quick pass
MAX_CONFIGS = 1500  # accepted configurations timed per shape at most (the "configs" column shows when it binds)
ENUM_MAX_ROWS = 1024  # larger products (prefill steps) time only the heuristic's candidates
L2_MISS_BYTES = 256 << 20  # weight copies cycled through per timing: several times the H100 / H200 L2


def bind(lib) -> None:
    """The cuBLASLt entry points ops/cublaslt.py does not declare."""
    p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    signatures = {
        "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(_Algo), i, p, size, ctypes.POINTER(size)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), i, p, size],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i, p, size, ctypes.POINTER(size)],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int


def capability_list(lib, algo: _Algo, attr: int) -> list[int]:
    """A uint32 array capability of `algo` (its size asked first); [] when it lists none."""
    written = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written)) != 0:
        return []
    count = written.value // 4
    if not count:
        return []
    values = (ctypes.c_uint32 * count)()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, 4 * count, ctypes.byref(written)):
        return []
    return list(values)


def config_of(lib, algo: _Algo) -> tuple[int, int, int]:
    """(tile id, stages id, split-K) of an algorithm, as cuBLASLt reports them."""
    values = []
    for attr in (_CONFIG_TILE_ID, _CONFIG_STAGES_ID, _CONFIG_SPLITK_NUM):
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                 ctypes.byref(written))
        values.append(value.value)
    return tuple(values)


def enumerated_algos(lib, handle, plan: _Plan, workspace_bytes: int) -> list[_Algo]:
    """Every configuration cuBLASLt accepts (cublasLtMatmulAlgoCheck) among the neighbours of the heuristic's
    candidates: each candidate with any tile its algorithm lists and split-K 1 / 2 / 4 / 8, the rest of its
    configuration (stages, cluster shape, swizzle, ...) kept. An algorithm id fresh from cublasLtMatmulAlgoInit
    is refused whatever its tile (session 60, an H100: status 7 / 15 for each of the 12 ids), so the search
    starts from configurations the heuristic made whole."""
    accepted, seen = [], set()
    for candidate in plan.algos:
        tiles = capability_list(lib, candidate, _CAP_TILE_IDS) or [config_of(lib, candidate)[0]]
        for tile, split in itertools.product(tiles, SPLITS_K):
            algo = _Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(candidate), ctypes.sizeof(_Algo))
            for attr, value in ((_CONFIG_TILE_ID, tile), (_CONFIG_SPLITK_NUM, split)):
                v = ctypes.c_uint32(value)
                lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4)
            if bytes(algo) in seen:
                continue
            seen.add(bytes(algo))
            result = _Heuristic()
            if (lib.cublasLtMatmulAlgoCheck(handle, plan.desc, plan.a, plan.b, plan.c, plan.c, ctypes.byref(algo),
                                            ctypes.byref(result)) == 0
                    and result.workspace_size <= workspace_bytes):
                accepted.append(algo)
                if len(accepted) >= MAX_CONFIGS:
                    return accepted
    return accepted


def timed_us(gemm: TunedGemm, plan: _Plan, algo: _Algo, calls, replays: int) -> float:
    """Median us a call of `algo` over the (xq, wq, acc) sets in `calls`, from `replays` graph replays
    (bench_kernels.graph_ms; its warm-up call, before the capture, raises for a configuration that cannot run)."""
    stream = cupy.cuda.Stream(non_blocking=True)

    def run_all():
        for xq, wq, acc in calls:
            gemm._run(plan, algo, xq, wq, acc, stream)
    return graph_ms(run_all, replays, stream) * 1e3 / len(calls)


def quick_us(gemm: TunedGemm, plan: _Plan, algo: _Algo, calls) -> float:
    """timed_us from one replay; inf for a configuration that AlgoCheck accepted and cublasLtMatmul refuses."""
    try:
        return timed_us(gemm, plan, algo, calls, 1)
    except (RuntimeError, cupy.cuda.runtime.CUDARuntimeError):
        return float("inf")


def search(gemm: TunedGemm, rows: int, inner: int, out: int) -> dict:
    """The fastest heur16 / heur64 / enum times (us) and the enum winner's config, for one product shape."""
    kp, np_ = fp8_padded(inner), fp8_padded(out)
    copies = max(2, -(-L2_MISS_BYTES // (kp * np_)))
    xq = e4m3_bits((rows, kp))
    wqs = [e4m3_bits((np_, kp)) for _ in range(copies)]
    acc = cupy.empty((rows, np_), dtype=BFLOAT16)  # the model's bfloat16 sums
    key = check_fp8_args(xq, wqs[0], acc, acc.dtype)
    calls = [(xq, wq, acc) for wq in wqs]
    results, plans, default = {}, {}, cublaslt.NUM_CANDIDATES
    for name, count in (("heur16", 16), ("heur64", 64)):
        cublaslt.NUM_CANDIDATES = count
        plans[name] = _Plan(gemm._lib, gemm._handle, key, gemm._workspace.nbytes, gemm.fp8_fast_accum)
        times = [timed_us(gemm, plans[name], algo, calls, 5) for algo in plans[name].algos]
        results[name] = min(times)
        results.setdefault("first", times[0])  # the 16-candidate query's first: what tune=False runs
    cublaslt.NUM_CANDIDATES = default
    plan = plans["heur64"]  # its descriptors and candidates seed the enumerated configurations
    if rows > ENUM_MAX_ROWS:
        results["enum"], results["enum_count"], results["enum_config"] = float("nan"), 0, None
        return results
    algos = enumerated_algos(gemm._lib, gemm._handle, plan, gemm._workspace.nbytes)
    quick = sorted((quick_us(gemm, plan, algo, calls[:2]), j) for j, algo in enumerate(algos))[:QUICK_KEEP]
    best = min((timed_us(gemm, plan, algos[j], calls, 5), j) for _, j in quick) if quick else (float("nan"), None)
    results["enum"], results["enum_count"] = best[0], len(algos)
    results["enum_config"] = config_of(gemm._lib, algos[best[1]]) if best[1] is not None else None
    return results


def e4m3_bits(shape) -> cupy.ndarray:
    """Random finite e4m3 bytes of both signs (bit 3, the exponent's lowest, cleared: no NaN)."""
    return cupy.random.randint(0, 256, shape, dtype=cupy.uint8) & np.uint8(0xF7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[144, 256, 64])
    parser.add_argument("--presets", nargs="+", default=["llama-3.1-8b"])
    args = parser.parse_args()
    copy = copy_bandwidth_gbs()
    gemm = TunedGemm(cupy.cuda.Stream(non_blocking=True))
    bind(gemm._lib)
    print(f"copy bandwidth {copy:,.0f} GB/s; FP8 e4m3 products into bfloat16, fast accumulation "
          f"{gemm.fp8_fast_accum}")
    print(f"{'preset':<14}{'proj':<9}{'rows':>6}{'first us':>10}{'heur16 us':>11}{'heur64 us':>11}{'enum us':>9}"
          f"{'configs':>9}{'w of copy':>11}{'enum/heur16':>13}  enum's (tile, stages, split-K)")
    for preset in args.presets:
        for name, k, n in projections(preset):
            if name == "lm_head":  # 16-bit in the FP8 model
                continue
            for rows in args.rows:
                r = search(gemm, rows, k, n)
                best = min(t for t in (r["heur16"], r["heur64"], r["enum"]) if t == t)  # NaN: not enumerated
                print(f"{preset:<14}{name:<9}{rows:>6}{r['first']:>10.1f}{r['heur16']:>11.1f}{r['heur64']:>11.1f}"
                      f"{r['enum']:>9.1f}"
                      f"{r['enum_count']:>9}{k * n / best / 1e3 / copy:>11.1%}{r['enum'] / r['heur16']:>13.2f}"
                      f"  {r['enum_config']}")


if __name__ == "__main__":
    main()
