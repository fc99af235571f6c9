"""Host cost of one structured-output step at the bench's shape: llguidance's work for R sequences.

    python benchmarks/bench_mask_fill.py [--rows 256] [--steps 60] [--preset llama-3.2-1b] [--threads 0,8,16] [--split 1]
        [--processes 1,2,4]

R matchers of `bench --structured json`'s schema over the dummy-weights token table of the preset
(128,256 ids at the 1B shape) are walked through random allowed tokens. Per step it times the parallel
mask fill (llguidance's thread pool, into one [R, W] int32 array), consuming one token per matcher one
call at a time, and consuming them in llguidance's parallel call. Prints the medians in ms. No GPU needed;
the figures depend on the host's cores (the device machine has 16).

--processes K (K > 1): the rows split over K processes, each with its own token table, matchers and pool of
--threads; every step starts on a barrier and costs the slowest process's fill. In one process llguidance's
fill stopped scaling at ~4 threads on the H200 host; this measures whether separate processes do better
(a mask server in worker processes would then pay).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from offline_paged.benchmark.bench import BENCH_SCHEMA
from offline_paged.core.grammar_tokenizer import ll_tokenizer
from offline_paged.models.dummy_weights import DummyTokenizer, preset_config


def _random_allowed(masks: np.ndarray, vocab_size: int, eos: int, rng) -> list[int]:
    """One allowed token per row, EOS only when nothing else is allowed."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # [R, V]
    tokens = []
    for row in bits:
        allowed = np.flatnonzero(row)
        others = allowed[allowed != eos]
        tokens.append(int(rng.choice(others if others.size else allowed)))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--threads", default="0", help="comma-separated LLExecutor pool sizes; 0: its default")
    parser.add_argument("--split", type=int, default=1,
                        help="fill from this many Python threads, each with its own pool and 1/split of the rows")
    parser.add_argument("--processes", default="1", help="comma-separated process counts (see above)")
    args = parser.parse_args()
    for threads in (int(t) for t in args.threads.split(",")):
        for processes in (int(k) for k in args.processes.split(",")):
            if processes == 1:
                measure(args, threads)
            else:
                measure_processes(args, threads, processes)


def _matchers(preset: str, rows: int):
    """(the preset's LlamaConfig, `rows` fresh matchers of the bench's schema over its dummy token table,
    their [rows, W] int32 mask array)."""
    config = preset_config(preset)
    table = ll_tokenizer(DummyTokenizer(config.eos_token_ids), config.vocab_size, config.eos_token_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(BENCH_SCHEMA))
    matchers = [llguidance.LLMatcher(table, grammar) for _ in range(rows)]
    return config, matchers, np.zeros((rows, (config.vocab_size + 31) // 32), dtype=np.int32)  # [rows, W]


def _pool(threads: int) -> llguidance.LLExecutor:
    """llguidance's thread pool of `threads` threads (0: its default)."""
    return llguidance.LLExecutor(num_threads=threads) if threads else llguidance.LLExecutor()


def _walk(args, threads: int, rows: int, barrier=None, seed: int = 0) -> list[float]:
    """Per step, seconds of one parallel fill of `rows` matchers walked through random allowed tokens."""
    config, matchers, masks = _matchers(args.preset, rows)
    executor = _pool(threads)
    rng, pairs, times = np.random.default_rng(seed), list(zip(matchers, range(rows))), []
    for _ in range(args.steps):
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        llg_numpy.fill_next_token_bitmask_par(executor, pairs, masks)
        times.append(time.perf_counter() - start)
        for matcher, token in zip(matchers, _random_allowed(masks, config.vocab_size, config.eos_token_ids[0], rng)):
            matcher.consume_token(token)
    return times


def _walk_in_process(args, threads, rows, barrier, seed, results) -> None:
    results.put(_walk(args, threads, rows, barrier, seed))


def measure_processes(args, threads: int, processes: int) -> None:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_walk_in_process,
                               args=(args, threads, args.rows // processes, barrier, k, results))
               for k in range(processes)]
    for worker in workers:
        worker.start()
    per_process = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    slowest = [max(step) for step in zip(*per_process)]  # [steps]
    print(f"{args.rows} rows, vocab {preset_config(args.preset).vocab_size}, {os.cpu_count()} cores, {processes} "
          f"processes x pool {threads or 'default'}: fill_par {1e3 * statistics.median(slowest):.2f} ms")


def measure(args, threads: int) -> None:
    config, matchers, masks = _matchers(args.preset, args.rows)
    eos = config.eos_token_ids[0]
    executors = [_pool(threads) for _ in range(args.split)]
    executor, rng = executors[0], np.random.default_rng(0)
    pairs = list(zip(matchers, range(args.rows)))
    chunks = [pairs[i::args.split] for i in range(args.split)]
    callers = concurrent.futures.ThreadPoolExecutor(args.split)
    times: dict[str, list[float]] = {"fill_par": [], "consume_serial": [], "consume_par": []}
    for step in range(args.steps):
        start = time.perf_counter()
        if args.split == 1:
            llg_numpy.fill_next_token_bitmask_par(executor, pairs, masks)
        else:
            list(callers.map(lambda e, c: llg_numpy.fill_next_token_bitmask_par(e, c, masks), executors, chunks))
        times["fill_par"].append(time.perf_counter() - start)
        tokens = _random_allowed(masks, config.vocab_size, eos, rng)
        start = time.perf_counter()
        if step % 2:
            llg_numpy.consume_token_par(executor, list(zip(matchers, tokens)))
            times["consume_par"].append(time.perf_counter() - start)
        else:
            for matcher, token in zip(matchers, tokens):
                matcher.consume_token(token)
            times["consume_serial"].append(time.perf_counter() - start)
    print(f"{args.rows} rows, vocab {config.vocab_size}, {os.cpu_count()} cores, {args.split} x pool {threads or 'default'}: " + ", ".join(
        f"{name} {1e3 * statistics.median(values):.2f} ms" for name, values in times.items()))


if __name__ == "__main__":
    main()
