"""CPU forward speed: our NumPy Llama vs transformers on SmolLM2-135M-Instruct, fp32, same weights.

Prints tokens/s for prefill (16 x 128 tokens) and decode (batch 16 and 64, after a 128-token prompt),
and the ratio ours / transformers. Numbers, not assertions: run it, read it.
    python benchmarks/bench_model_cpu.py [--decode-steps 32]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import LlamaForCausalLM

from offline_paged.models.llama import Llama
from offline_paged.models.loader import load_model
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.ops_numpy import NumpyOps

PROMPT_LEN = 128


def ours_run(model, batch: int, steps: int, block_size: int = 16) -> tuple[float, float]:
    """(prefill seconds, decode seconds for `steps` steps) for `batch` random prompts."""
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, PROMPT_LEN)).tolist()
    blocks = batch * (-(-(PROMPT_LEN + steps) // block_size)) + 8
    runner = SimpleRunner(model, blocks, block_size)
    t0 = time.perf_counter()
    rows = runner.step(list(enumerate(prompts)))
    t1 = time.perf_counter()
    for _ in range(steps):
        rows = runner.step([(i, [int(np.argmax(r))]) for i, r in enumerate(rows)])
    return t1 - t0, time.perf_counter() - t1


@torch.no_grad()
def hf_run(model, batch: int, steps: int) -> tuple[float, float]:
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, PROMPT_LEN)))
    t0 = time.perf_counter()
    out = model(ids, use_cache=True)
    t1 = time.perf_counter()
    past, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        out = model(next_ids, past_key_values=past, use_cache=True)
        past, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args()
    loaded = load_model()
    ours = Llama(loaded.config, loaded.weights, NumpyOps())
    hf = LlamaForCausalLM.from_pretrained(loaded.source, dtype=torch.float32).eval()
    print(f"torch threads {torch.get_num_threads()}; model {loaded.source}")
    print(f"{'phase':<22}{'ours tok/s':>12}{'hf tok/s':>12}{'ratio':>8}")
    for batch in (16, 64):
        o_pre, o_dec = ours_run(ours, batch, args.decode_steps)
        h_pre, h_dec = hf_run(hf, batch, args.decode_steps)
        if batch == 16:
            _row(f"prefill {batch}x{PROMPT_LEN}", batch * PROMPT_LEN / o_pre, batch * PROMPT_LEN / h_pre)
        _row(f"decode batch {batch}", batch * args.decode_steps / o_dec, batch * args.decode_steps / h_dec)


def _row(name: str, ours: float, hf: float) -> None:
    print(f"{name:<22}{ours:>12.1f}{hf:>12.1f}{ours / hf:>8.2f}")


if __name__ == "__main__":
    main()
