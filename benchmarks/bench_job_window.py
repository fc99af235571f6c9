"""A `generate` job's read-ahead window (--max-pending) on random weights: the bench's workload as prompt-id lines
through the JobRunner, one fresh engine per run (a second run on one engine would hit the prefix cache), windows
interleaved --repeat times (--with-bench: and the workload as `offline-paged bench` runs it, every request added up
front). Prints one JSON line per run, then a table of out tok/s and the ratio to the first window of the same
repeat.

    python benchmarks/bench_job_window.py --dummy-weights llama-3.2-1b --num-requests 4096 --window 1024 --window 2048

The job pays what the bench does not: lines parsed and checked, records built and written (here into memory).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline_paged.benchmark.bench import (max_total_len, parse_length_range, random_workload,  # noqa: E402
                                           release_device_memory, run_bench, sharegpt_like_workload, warm_up)
from offline_paged.core.config import EngineConfig  # noqa: E402
from offline_paged.engine import LLMEngine  # noqa: E402
from offline_paged.job.job_file import JsonlWriter  # noqa: E402
from offline_paged.job.job_runner import JobRunner  # noqa: E402
from offline_paged.worker.backend import select_backend  # noqa: E402

from models.dummy_weights import dummy_model  # noqa: E402


def job_lines(requests: list) -> list[str]:
    """The workload as `generate` lines of prompt ids, each decoding exactly its bench length (ignore_eos)."""
    return [json.dumps({"id": f"r{index}", "prompt_token_ids": request.prompt_token_ids,
                        "max_tokens": request.params.max_tokens, "min_tokens": request.params.min_tokens,
                        "ignore_eos": True,
                        "temperature": request.params.temperature})
            for index, request in enumerate(requests)]


def run_fresh(config: EngineConfig, loaded, window: int | str, run) -> dict:
    """`run(engine) -> (wall seconds, output tokens)` on a fresh, warmed engine (a second run on one engine would
    hit the prefix cache): its out tok/s and steps, and the engine's start (KV pool sizing, graph captures, warm-up)."""
    start = time.perf_counter()
    engine = LLMEngine(config, loaded_model=loaded)
    try:
        warm_up(engine, loaded.config.vocab_size)
        start_s = time.perf_counter() - start
        steps_before = engine.stats.num_steps
        wall, output_tokens = run(engine)
        return {"window": window, "wall_s": round(wall, 3), "output_tokens": output_tokens,
                "output_tokens_per_s": round(output_tokens / wall, 1),
                "num_steps": engine.stats.num_steps - steps_before, "max_num_seqs": engine.config.max_num_seqs,
                "engine_start_s": round(start_s, 2)}
    finally:
        engine.close()


def job(lines: list[str], window: int):
    """The lines as a `generate` job at read-ahead `window`, records written into memory."""
    def run(engine) -> tuple[float, int]:
        out = io.BytesIO()
        start = time.perf_counter()
        summary = JobRunner(engine, JsonlWriter(out), max_pending=window).run(lines)
        wall = time.perf_counter() - start
        if summary.num_failed or summary.num_succeeded != len(lines):
            raise RuntimeError(f"window {window}: {summary.num_failed} failed, {summary.num_succeeded} succeeded")
        return wall, sum(json.loads(line)["usage"]["completion_tokens"] for line in out.getvalue().splitlines())
    return run


def bench(requests: list):
    """The same workload as `offline-paged bench` runs it (`run_bench`: every request added up front)."""
    def run(engine) -> tuple[float, int]:
        result = run_bench(engine, requests)
        return result.wall_s, result.num_output_tokens
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dummy-weights", default="llama-3.2-1b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=4096)
    parser.add_argument("--dataset", choices=("nano-vllm", "sharegpt-like"), default="nano-vllm")
    parser.add_argument("--input-len", default="100:1024")
    parser.add_argument("--output-len", default="100:1024")
    parser.add_argument("--window", type=int, action="append", help="--max-pending values (repeat)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--with-bench", action="store_true",
                        help="each repeat also runs the workload as `offline-paged bench` does "
                             "(requests added up front)")
    args = parser.parse_args(argv)
    windows = args.window or [1024, 2048]
    backend = select_backend(args.device, "auto", None, None)
    loaded = dummy_model(args.dummy_weights, backend.xp, backend.dtype, 0)
    vocab = loaded.config.vocab_size
    if args.dataset == "sharegpt-like":
        requests = sharegpt_like_workload(args.num_requests, vocab, 0, 1.0)
    else:
        requests = random_workload(args.num_requests, parse_length_range(args.input_len),
                                   parse_length_range(args.output_len), vocab, 0, 1.0)
    config = EngineConfig(device=backend.name, dtype=backend.dtype.name, max_model_len=max_total_len(requests),
                          max_num_seqs=args.max_num_seqs)
    lines = job_lines(requests)
    results = []
    runs = [(window, job(lines, window)) for window in windows]
    if args.with_bench:
        runs.append(("bench", bench(requests)))
    for repeat in range(args.repeat):
        for window, run in runs:
            result = run_fresh(config, loaded, window, run) | {"repeat": repeat + 1}
            print(json.dumps(result), flush=True)
            results.append(result)
            release_device_memory(backend)
    print(f"{'repeat':>6} {'window':>7} {'out tok/s':>10} {'steps':>6} {'ratio':>6} {'start s':>8}  "
          f"({args.dummy_weights}, {args.dataset}, N = {args.num_requests}, {backend.name})")
    for result in results:
        first = next(r for r in results if r["repeat"] == result["repeat"])
        print(f"{result['repeat']:>6} {result['window']:>7} {result['output_tokens_per_s']:>10,.0f} "
              f"{result['num_steps']:>6} {result['output_tokens_per_s'] / first['output_tokens_per_s']:>6.3f} "
              f"{result['engine_start_s']:>8.2f}")


if __name__ == "__main__":
    main()
