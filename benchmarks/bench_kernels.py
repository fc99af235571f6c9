"""Kernel benchmark (GPU): paged decode attention and prefill attention, with peers measured in the same run.

Decode: batch x context x block size x head dim x GQA. For each point: the median of CUDA-event-timed
CUDA-graph replays (kernel time without Python launch overhead; the eager per-call time is reported too) of our kernel on a shuffled block table, the achieved bandwidth (bytes of K/V read / time)
against the device-to-device copy bandwidth measured here ((read + written) / time), the same kernel
on an identity block table (paging overhead = shuffled / identity - 1), and torch's
scaled_dot_product_attention on contiguous K/V (ratio = ours / torch; < 1 means we are faster).
Prefill: one sequence of L tokens attending causally to itself, ours vs torch SDPA (is_causal).

    python benchmarks/bench_kernels.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import cupy
import numpy as np
import torch

from offline_paged.ops import launchers

NUM_HEADS = 32
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
BLOCK_SIZES = (16, 32)
HEAD_DIMS = (64, 128)
GQAS = (4, 8)
PREFILL_LENGTHS = (1024, 2048, 4096, 8192)
MAX_KV_BYTES = 40 << 30  # per K/V pool pair; larger points are skipped


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def random_f16(n: int):
    """n standard-normal fp16 values, generated in slices (a float32 temporary of n values may not fit)."""
    out = cupy.empty(n, dtype=cupy.float16)
    step = 1 << 28
    for i in range(0, n, step):
        out[i:i + step] = cupy.random.standard_normal(min(step, n - i), dtype=cupy.float32).astype(cupy.float16)
    return out


def graph_ms(fn, repeats: int, stream=None) -> float:
    """GPU time of fn without Python launch overhead: fn is captured into a CUDA graph once (after a
    warm-up on the capture stream, so the memory pool serves its allocations) and replays are timed.
    `stream`: the capture stream (None: a new one), for callees bound to a stream (TunedGemm)."""
    stream = stream or cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        for _ in range(2):
            graph.launch(stream)
        times = []
        for _ in range(repeats):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def torch_graph_ms(fn, repeats: int) -> float:
    """The same for torch: capture into torch.cuda.CUDAGraph, time replays; nan if the peer fails
    (a math fallback that expands GQA heads can run out of memory)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(2):
            graph.replay()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return statistics.median(times)
    except RuntimeError as exc:
        print(f"  torch peer failed: {str(exc).splitlines()[0][:120]}", flush=True)
        torch.cuda.empty_cache()
        return float("nan")


def copy_bandwidth_gbs() -> float:
    """(bytes read + bytes written) / time of a 4 GiB device-to-device copy."""
    nbytes = 4 << 30
    src, dst = cupy.empty(nbytes, dtype=cupy.uint8), cupy.empty(nbytes, dtype=cupy.uint8)
    src.fill(1)
    ms = median_ms(lambda: dst.data.copy_from_device_async(src.data, nbytes), repeats=10)
    del src, dst
    return 2 * nbytes / ms / 1e6


def decode_grid(copy_gbs: float, quick: bool) -> list[dict]:
    rows = []
    repeats = 5 if quick else 10
    batches, contexts = ((1, 64, 256), (2048, 32768)) if quick else (BATCHES, CONTEXTS)
    for head_dim in HEAD_DIMS:
        for gqa in GQAS:
            num_kv_heads = NUM_HEADS // gqa
            token_bytes = num_kv_heads * head_dim * 2
            max_tokens = max(b * c for b in batches for c in contexts if b * c * token_bytes * 2 <= MAX_KV_BYTES)
            k_pool = random_f16(max_tokens * num_kv_heads * head_dim)
            v_pool = random_f16(max_tokens * num_kv_heads * head_dim)
            k_torch = torch.randn(max_tokens * num_kv_heads * head_dim, device="cuda", dtype=torch.float16)
            v_torch = torch.randn(max_tokens * num_kv_heads * head_dim, device="cuda", dtype=torch.float16)
            for batch in batches:
                for context in contexts:
                    if batch * context > max_tokens:
                        continue
                    rows += decode_point(k_pool, v_pool, k_torch, v_torch, batch, context, head_dim, num_kv_heads,
                                         copy_gbs, repeats)
                    print(_decode_line(rows[-1]), flush=True)
            del k_pool, v_pool, k_torch, v_torch
            cupy.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    return rows


def decode_point(k_pool, v_pool, k_torch, v_torch, batch, context, head_dim, num_kv_heads, copy_gbs, repeats):
    rng = np.random.default_rng(batch * context)
    q = cupy.random.standard_normal((batch, NUM_HEADS, head_dim), dtype=cupy.float32).astype(cupy.float16)
    context_lens = cupy.full(batch, context, dtype=cupy.int32)
    query_start_loc = cupy.arange(batch + 1, dtype=cupy.int32)
    scale = head_dim ** -0.5
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
    # torch peer: contiguous [S, Hkv, C, D] K/V, one query per sequence, grouped heads.
    qt = torch.randn(batch, NUM_HEADS, 1, head_dim, device="cuda", dtype=torch.float16)
    kt = k_torch[:batch * num_kv_heads * context * head_dim].view(batch, num_kv_heads, context, head_dim)
    vt = v_torch[:batch * num_kv_heads * context * head_dim].view(batch, num_kv_heads, context, head_dim)
    torch_ms = torch_graph_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), repeats)
    rows = []
    for block_size in BLOCK_SIZES:
        blocks_per_seq = context // block_size
        num_blocks = k_pool.size // (block_size * num_kv_heads * head_dim)
        k_cache = k_pool[:num_blocks * block_size * num_kv_heads * head_dim].reshape(num_blocks, block_size, num_kv_heads, head_dim)
        v_cache = v_pool[:num_blocks * block_size * num_kv_heads * head_dim].reshape(num_blocks, block_size, num_kv_heads, head_dim)
        used = batch * blocks_per_seq
        shuffled = cupy.asarray(rng.permutation(num_blocks)[:used].astype(np.int32).reshape(batch, blocks_per_seq))
        identity = cupy.arange(used, dtype=cupy.int32).reshape(batch, blocks_per_seq)

        def ours(table):
            return lambda: launchers.paged_attention(q, k_cache, v_cache, table, context_lens, query_start_loc,
                                                     1, context, scale)

        paged_ms = graph_ms(ours(shuffled), repeats)
        identity_ms = graph_ms(ours(identity), repeats)
        call_ms = median_ms(ours(shuffled), repeats)  # eager, Python launch overhead included
        splits, _ = launchers.plan_splits(batch * num_kv_heads, context, batch * NUM_HEADS * head_dim * 4)
        achieved = kv_bytes / paged_ms / 1e6
        rows.append(dict(batch=batch, context=context, block_size=block_size, head_dim=head_dim,
                         gqa=NUM_HEADS // num_kv_heads, splits=splits, ms=paged_ms, gbs=achieved,
                         pct_copy=100 * achieved / copy_gbs, identity_ms=identity_ms,
                         paging_overhead_pct=100 * (paged_ms / identity_ms - 1), torch_ms=torch_ms, call_ms=call_ms,
                         ratio_vs_torch=paged_ms / torch_ms))
    return rows


def _decode_line(r: dict) -> str:
    return (f"{r['head_dim']:>4} {r['gqa']:>3} {r['block_size']:>3} {r['batch']:>5} {r['context']:>6} {r['splits']:>4} "
            f"{r['ms']:>9.4f} {r['gbs']:>8.0f} {r['pct_copy']:>6.1f}% {r['paging_overhead_pct']:>+7.1f}% "
            f"{r['torch_ms']:>9.4f} {r['ratio_vs_torch']:>6.2f} {r['call_ms']:>9.4f}")


def prefill_rows(quick: bool) -> list[dict]:
    rows = []
    for head_dim, num_kv_heads in ((128, 8), (64, 8)):
        for length in PREFILL_LENGTHS[:2] if quick else PREFILL_LENGTHS:
            block_size = 16
            num_blocks = length // block_size
            q = cupy.random.standard_normal((length, NUM_HEADS, head_dim), dtype=cupy.float32).astype(cupy.float16)
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            k_cache = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
            v_cache = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
            table = cupy.asarray(np.random.default_rng(length).permutation(num_blocks).astype(np.int32)[None])
            ctx = cupy.asarray([length], dtype=cupy.int32)
            qsl = cupy.asarray([0, length], dtype=cupy.int32)
            ms = graph_ms(lambda: launchers.paged_attention(q, k_cache, v_cache, table, ctx, qsl, length, length,
                                                             head_dim ** -0.5), 5)
            qt = torch.randn(1, NUM_HEADS, length, head_dim, device="cuda", dtype=torch.float16)
            kt = torch.randn(1, num_kv_heads, length, head_dim, device="cuda", dtype=torch.float16)
            vt = torch.randn(1, num_kv_heads, length, head_dim, device="cuda", dtype=torch.float16)
            torch_ms = torch_graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, enable_gqa=True), 5)
            flops = 4 * length * length * NUM_HEADS * head_dim / 2  # QK^T and PV, causal half
            rows.append(dict(length=length, head_dim=head_dim, gqa=NUM_HEADS // num_kv_heads, ms=ms,
                             tflops=flops / ms / 1e9, torch_ms=torch_ms, ratio_vs_torch=ms / torch_ms))
            r = rows[-1]
            print(f"prefill L={length:>5} D={head_dim:>3} GQA {r['gqa']}: ours {ms:8.3f} ms ({r['tflops']:6.1f} TFLOP/s)"
                  f"  torch SDPA {torch_ms:8.3f} ms  ratio {r['ratio_vs_torch']:5.2f}", flush=True)
    return rows


def summary(decode: list[dict], copy_gbs: float) -> None:
    big = [r for r in decode if r["batch"] * r["context"] >= 64 * 4096]
    print(f"\n== decode summary (copy bandwidth {copy_gbs:.0f} GB/s, read+write) ==")
    print("   D GQA   B batch context splits  ms(graph)  GB/s   %copy   paging  torch_ms ours/torch call_ms(eager)")
    for r in decode:
        print(_decode_line(r))
    if big:
        print(f"batch*context >= 64*4k: {len(big)} points, %copy min {min(r['pct_copy'] for r in big):.1f} "
              f"median {statistics.median(r['pct_copy'] for r in big):.1f}; paging overhead median "
              f"{statistics.median(r['paging_overhead_pct'] for r in big):+.1f}% max "
              f"{max(r['paging_overhead_pct'] for r in big):+.1f}%; ours/torch median "
              f"{statistics.median(r['ratio_vs_torch'] for r in big):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a trimmed grid")
    parser.add_argument("--json", help="also write every row to this file")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, torch {torch.__version__}")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    prefill = [] if args.skip_prefill else prefill_rows(args.quick)
    decode = decode_grid(copy_gbs, args.quick)
    summary(decode, copy_gbs)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(copy_gbs=copy_gbs, decode=decode, prefill=prefill), f, indent=1)


if __name__ == "__main__":
    main()
