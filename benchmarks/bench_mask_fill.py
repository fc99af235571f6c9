"""Host cost of one structured-output step at the bench's shape: llguidance's work for R sequences.

    python benchmarks/bench_mask_fill.py [--rows 256] [--steps 60] [--preset llama-3.2-1b] [--threads 0,8,16] [--split 1]

R matchers of `bench --structured json`'s schema over the dummy-weights token table of the preset
(128,256 ids at the 1B shape) are walked through random allowed tokens. Per step it times the parallel
mask fill (llguidance's thread pool, into one [R, W] int32 array), consuming one token per matcher one
call at a time, and consuming them in llguidance's parallel call. Prints the medians in ms. No GPU needed;
the figures depend on the host's cores (the device machine has 16).
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
    args = parser.parse_args()
    for threads in (int(t) for t in args.threads.split(",")):
        measure(args, threads)


def measure(args, threads: int) -> None:
    config = preset_config(args.preset)
    eos = config.eos_token_ids[0]
    table = ll_tokenizer(DummyTokenizer(config.eos_token_ids), config.vocab_size, config.eos_token_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(BENCH_SCHEMA))
    matchers = [llguidance.LLMatcher(table, grammar) for _ in range(args.rows)]
    masks = np.zeros((args.rows, (config.vocab_size + 31) // 32), dtype=np.int32)  # [R, W]
    executors = [llguidance.LLExecutor(num_threads=threads) if threads else llguidance.LLExecutor()
                 for _ in range(args.split)]
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
