"""Engine vs transformers `generate` on the CPU, same prompts, same max_tokens, one run.

    python benchmarks/bench_engine_cpu.py [--num-prompts 64] [--max-tokens 64] [--skip-hf]

Both decode greedily and generate exactly max_tokens tokens per prompt (ignore_eos / min_new_tokens),
so both do the same work. transformers runs the whole batch at once, left-padded. Prints generated
tokens/s for each, the ratio, and the engine's KV statistics (utilization = filled slots / slots of
allocated blocks, averaged over steps).
"""
from __future__ import annotations

import argparse
import time

TOPICS = ["the tides", "photosynthesis", "a binary heap", "the French revolution", "TCP handshakes",
          "sourdough bread", "black holes", "the immune system", "compound interest", "jazz harmony",
          "plate tectonics", "hash tables", "the water cycle", "Roman aqueducts", "garbage collection",
          "bees"]
STYLES = ["Explain {} to a child.", "Write a short poem about {}.",
          "Give three facts about {}, one line each.",
          "You are a patient teacher. A student who has never heard of it asks about {}. "
          "Answer with a clear explanation, an everyday analogy and one common misconception."]


def build_prompts(tokenizer, count: int) -> list[str]:
    prompts = []
    for i in range(count):
        question = STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)])
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": question}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return prompts


def run_engine(prompts: list[str], max_tokens: int):
    from offline_paged.entrypoints.llm import LLM
    from offline_paged.core.sampling_params import SamplingParams

    llm = LLM(device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated, elapsed, llm.stats, outputs


def run_transformers(model_dir: str, prompts: list[str], max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    new_tokens = out[:, batch["input_ids"].shape[1]:]
    return new_tokens.numel(), elapsed, new_tokens.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="time only the engine")
    args = parser.parse_args()

    from offline_paged.models.default_model import default_model_dir, ensure_default_model
    from offline_paged.models.loader import load_model

    ensure_default_model()
    tokenizer = load_model(None).tokenizer
    prompts = build_prompts(tokenizer, args.num_prompts)
    generated, elapsed, stats, outputs = run_engine(prompts, args.max_tokens)
    engine_rate = generated / elapsed
    print(f"engine:       {generated} tokens in {elapsed:.1f} s = {engine_rate:.1f} tok/s")
    print(f"  KV utilization avg {stats.kv_utilization_average:.1%} (final step "
          f"{stats.kv_utilization_current:.1%}), block usage peak {stats.kv_block_usage_peak:.1%} of "
          f"{stats.num_gpu_blocks} blocks, prefix-cache hit rate {stats.prefix_cache_hit_rate:.1%}, "
          f"preemptions {stats.num_preemptions}, steps {stats.num_steps}")
    if args.skip_hf:
        return
    hf_generated, hf_elapsed, hf_tokens = run_transformers(str(default_model_dir()), prompts, args.max_tokens)
    hf_rate = hf_generated / hf_elapsed
    same = sum(o.outputs[0].token_ids == t for o, t in zip(outputs, hf_tokens))
    print(f"transformers: {hf_generated} tokens in {hf_elapsed:.1f} s = {hf_rate:.1f} tok/s")
    print(f"ratio engine / transformers: {engine_rate / hf_rate:.2f}x; "
          f"identical greedy outputs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
