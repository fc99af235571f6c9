"""What LLM.generate spends before its first step: adding N text prompts one by one (each tokenised by
add_request) against the same texts tokenised in one batch first (LLM._with_token_ids, what generate does),
alternating, medians of REPEAT; then tokenising alone both ways. No forward runs (the requests are aborted).

    python benchmarks/bench_llm_adds.py MODEL_DIR [--num-prompts 2000] [--words 180] [--repeat 3]

MODEL_DIR: a model directory with a tokenizer (the default model's: ~/.cache/offline-paged/SmolLM2-135M-Instruct).
The prompts are --words common English words each (one token apiece in the usual vocabularies).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from bench_host_step import WORDS

from offline_paged import LLM, SamplingParams


def added_in(llm: LLM, prompts: list, prepare: bool) -> float:
    """Seconds to turn `prompts` into requests (batch-tokenising first when `prepare`); the requests are withdrawn."""
    params = SamplingParams(max_tokens=8)
    start = time.perf_counter()
    ready = llm._with_token_ids(prompts) if prepare else prompts
    request_ids = [llm._add(prompt, params) for prompt in ready]
    seconds = time.perf_counter() - start
    for request_id in request_ids:
        llm.engine.abort_request(request_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--words", type=int, default=180)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model_dir, device="cpu", num_kv_blocks=64)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(args.words)) for _ in range(args.num_prompts)]
    runs = {"one by one": [], "batched": []}
    for _ in range(args.repeat):
        runs["one by one"].append(added_in(llm, texts, prepare=False))
        runs["batched"].append(added_in(llm, texts, prepare=True))
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        print(f"adding, {name:<11} {median:.3f} s for {len(texts)} prompts ({1e3 * median / len(texts):.3f} ms each)")
    tokenizer = llm.engine.tokenizer
    for _ in range(2):
        start = time.perf_counter()
        for text in texts:
            tokenizer.encode(text)
        one_by_one = time.perf_counter() - start
        start = time.perf_counter()
        tokenizer.encode_batch(texts)
        batched = time.perf_counter() - start
        print(f"tokenising alone: one by one {1e3 * one_by_one / len(texts):.3f} ms, "
              f"batched {1e3 * batched / len(texts):.3f} ms a text")
    llm.close()


if __name__ == "__main__":
    main()
