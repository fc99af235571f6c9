"""Block manager bookkeeping cost: one decode step for 256 sequences, and a 10k-request admission run.

Prints figures; asserts nothing (tests assert behaviour, benchmarks measure).
Run: .venv/bin/python benchmarks/bench_block_manager.py [--steps 2000] [--requests 10000]

Decode step = for each of 256 running sequences `append_slots(seq, 1)`, then export every block
table (what the runner reads). "+ mark_computed" adds the per-step prefix-cache registration call the
scheduler makes. The peer line times a bare Python loop over the same 256 sequences doing nothing but
a dict lookup and a list append, the floor any pure-Python bookkeeping pays.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque

from offline_paged.core.block_manager import BlockManager

BLOCK_SIZE = 16
TARGET_MS = 1.0


def _summary(samples_s: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (f"median {statistics.median(ms):.3f} ms  mean {statistics.fmean(ms):.3f} ms  "
            f"p99 {p99:.3f} ms  max {ms[-1]:.3f} ms")


def _running_batch(num_seqs: int, num_forks: int, rng: random.Random):
    """A manager with `num_seqs` computed sequences (prompts of 100-600 tokens); with num_forks > 1,
    groups of that many samples share one prompt (their first decode step copies the tail)."""
    bm = BlockManager(num_gpu_blocks=num_seqs * 200, num_cpu_blocks=0, block_size=BLOCK_SIZE)
    tokens: dict[int, list[int]] = {}
    for group in range(num_seqs // num_forks):
        root = group * num_forks
        prompt = [rng.randrange(49152) for _ in range(rng.randrange(100, 600))]
        bm.allocate(root, prompt)
        bm.mark_computed(root, prompt, len(prompt))
        tokens[root] = prompt
        for child in range(root + 1, root + num_forks):
            bm.fork(root, child)
            tokens[child] = list(prompt)
    return bm, tokens


def bench_decode(num_seqs: int, num_steps: int, num_forks: int, with_mark: bool) -> list[float]:
    rng = random.Random(0)
    bm, tokens = _running_batch(num_seqs, num_forks, rng)
    seq_ids = list(tokens)
    samples = []
    for _ in range(num_steps):
        for seq_id in seq_ids:  # the sampled token of the previous step (sequence layer, untimed)
            tokens[seq_id].append(rng.randrange(49152))
        start = time.perf_counter()
        copies = []
        for seq_id in seq_ids:
            copies += bm.append_slots(seq_id, 1)
        tables = [bm.block_table(seq_id) for seq_id in seq_ids]
        if with_mark:
            for seq_id in seq_ids:
                toks = tokens[seq_id]
                bm.mark_computed(seq_id, toks, len(toks))
        samples.append(time.perf_counter() - start)
        assert len(tables) == num_seqs
    return samples


def bench_peer(num_seqs: int, num_steps: int) -> list[float]:
    lengths = {seq_id: 0 for seq_id in range(num_seqs)}
    out: list[int] = []
    samples = []
    for _ in range(num_steps):
        start = time.perf_counter()
        out.clear()
        for seq_id in lengths:
            out.append(lengths[seq_id])
        samples.append(time.perf_counter() - start)
    return samples


def bench_admission(num_requests: int, num_gpu_blocks: int) -> None:
    """Admit `num_requests` prompts (a few shared system prompts + unique questions) into a pool that
    holds ~100 of them; the oldest running request finishes whenever the next one does not fit."""
    rng = random.Random(1)
    system_prompts = [[rng.randrange(49152) for _ in range(rng.randrange(64, 257))] for _ in range(8)]
    prompts = [
        rng.choice(system_prompts) + [rng.randrange(49152) for _ in range(rng.randrange(16, 400))]
        for _ in range(num_requests)
    ]
    bm = BlockManager(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, block_size=BLOCK_SIZE)
    running: deque[int] = deque()
    per_request = []
    start_all = time.perf_counter()
    for seq_id, prompt in enumerate(prompts):
        start = time.perf_counter()
        while not bm.can_allocate(prompt):
            bm.free(running.popleft())
        bm.allocate(seq_id, prompt)
        bm.mark_computed(seq_id, prompt, len(prompt))
        per_request.append(time.perf_counter() - start)
        running.append(seq_id)
    total = time.perf_counter() - start_all
    mean_len = statistics.fmean(len(p) for p in prompts)
    print(f"admission: {num_requests} requests (mean {mean_len:.0f} tokens) into {num_gpu_blocks} "
          f"blocks in {total * 1e3:.0f} ms ({total / num_requests * 1e6:.1f} us/request incl. frees)")
    print(f"  per request (can_allocate + allocate + mark_computed): {_summary(per_request)}")
    print(f"  prefix-cache hit rate {bm.prefix_cache_hit_rate:.1%} of prompt tokens, "
          f"{bm.gpu_allocator.num_cached_blocks} cached blocks at the end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    peer = statistics.median(bench_peer(args.seqs, args.steps))
    print(f"decode step bookkeeping, {args.seqs} sequences, block size {BLOCK_SIZE}, "
          f"{args.steps} steps (target < {TARGET_MS} ms):")
    print(f"  peer (bare loop over {args.seqs} seqs): median {peer * 1e3:.3f} ms")
    for label, forks, mark in (
        ("append_slots + table export", 1, False),
        ("append_slots + table export + mark_computed", 1, True),
        ("same, 64 prompts x 4 forked samples (CoW)", 4, True),
    ):
        samples = bench_decode(args.seqs, args.steps, forks, mark)
        ratio = statistics.median(samples) / peer
        print(f"  {label}: {_summary(samples)}  ({ratio:.0f}x peer)")
    bench_admission(args.requests, num_gpu_blocks=2000)


if __name__ == "__main__":
    main()
