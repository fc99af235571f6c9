"""Side-by-side throughput on one GPU, one process, same random weights: offline-paged (paged KV) vs
its contiguous-reservation baseline vs HF transformers `generate` (padded static batch) and, when the
installed transformers has it, HF continuous batching (`generate_batch`).

    python3 benchmarks/side_by_side.py --out $OUT --deadline-s 420

Phases run in priority order and each one is skipped (and said so) when too little of the deadline
is left; every finished phase is appended to OUT/side_by_side.jsonl at once, so a killed run still
reports what it finished. Sampling is greedy everywhere (so host sampling cost is the same kind of
work for all), lengths are exact (ignore_eos / min_new_tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from offline_paged.benchmark.bench import (kv_bytes_per_token, max_total_len, measure_ceilings,
                                           parse_length_range, random_workload, release_device_memory, run_bench,
                                           warm_up)
from offline_paged.benchmark.bench_report import format_details, matplotlib_available, plot_kv
from offline_paged.core.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.models.dummy_weights import dummy_model
from offline_paged.worker.backend import select_backend

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/sbs")
    p.add_argument("--deadline-s", type=float, default=420)
    p.add_argument("--presets", default="llama-3.2-1b,smollm2-135m,llama-3.1-8b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=128 * 2048,
                   help="KV budget in tokens for both layouts (contiguous fits this / max_model_len seqs)")
    p.add_argument("--lens", default="100:1024", help="prompt and output length range (smoke tests)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "side_by_side.jsonl"
    backend = select_backend(args.device, "float16" if args.device == "cuda" else None)
    ceilings = measure_ceilings(backend)
    emit(log, {"phase": "ceilings", "bandwidth_gb_s": ceilings.bandwidth / 1e9,
               "matmul_tflop_s": ceilings.matmul_flops / 1e12, "how": ceilings.how})
    for preset in args.presets.split(","):
        run_preset(preset, args, backend, ceilings, log)
    print_table(log)
    return 0


def emit(log: Path, record: dict) -> None:
    record["t_s"] = round(elapsed(), 1)
    with log.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print("RESULT", json.dumps(record), flush=True)


def time_left(args) -> float:
    return args.deadline_s - elapsed()


def run_preset(preset, args, backend, ceilings, log) -> None:
    if time_left(args) < 60:
        emit(log, {"phase": "skipped", "preset": preset, "why": "deadline"})
        return
    loaded = dummy_model(preset, backend.xp, backend.dtype, seed=0)
    lens = parse_length_range(args.lens)
    requests = random_workload(args.num_requests, lens, lens, loaded.config.vocab_size,
                               seed=0, temperature=0.0)
    max_len = max_total_len(requests)
    kv_memory = args.kv_tokens * kv_bytes_per_token(loaded.config, backend.dtype.itemsize)
    layouts = ["paged", "contiguous"] if preset != "llama-3.1-8b" else ["paged"]
    results = []
    for layout in layouts:
        if time_left(args) < 45:
            emit(log, {"phase": "skipped", "preset": preset, "layout": layout, "why": "deadline"})
            continue
        try:
            config = EngineConfig(device=backend.name, kv_cache_memory=kv_memory, max_model_len=max_len,
                                  max_num_seqs=256, max_num_batched_tokens=8192, kv_layout=layout)
            engine = LLMEngine(config, loaded_model=loaded)
            warm_up(engine, loaded.config.vocab_size)
            result = run_bench(engine, requests, label=f"{preset} {layout}", kv_layout=layout,
                               ceilings=ceilings)
            print("\n".join(format_details(result)), flush=True)
            emit(log, {"phase": "ours", "preset": preset, **result.summary()})
            results.append(result)
        except Exception as exc:  # keep going: the other phases still tell something
            traceback.print_exc()
            emit(log, {"phase": "ours-failed", "preset": preset, "layout": layout, "error": repr(exc)})
        finally:
            engine = None
            release_device_memory(backend)
    if results and matplotlib_available():
        plot_kv(results, str(Path(args.out) / f"kv_{preset}.png"))
    if preset != "llama-3.1-8b":
        hf_phases(preset, loaded, requests[:args.hf_requests], args, log, backend.name)
    del loaded
    release_device_memory(backend)


def hf_model(loaded, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**loaded.config.to_dict())
    dtype = torch.float16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(hf_config).to(dtype).eval()
    with torch.no_grad():  # the very same weights as ours (cupy -> torch through DLPack)
        for name, param in model.named_parameters():
            if name in loaded.weights:
                param.copy_(torch.from_dlpack(loaded.weights[name]))
    return model


def hf_phases(preset, loaded, requests, args, log, device) -> None:
    import torch

    if time_left(args) < 45:
        emit(log, {"phase": "skipped", "preset": preset, "what": "hf", "why": "deadline"})
        return
    model = hf_model(loaded, device)
    try:
        emit(log, {"phase": "hf-static", "preset": preset, **hf_static(model, requests)})
    except Exception as exc:
        traceback.print_exc()
        emit(log, {"phase": "hf-static-failed", "preset": preset, "error": repr(exc)})
    if time_left(args) < 45 or not hasattr(model, "generate_batch"):
        emit(log, {"phase": "skipped", "preset": preset, "what": "hf-cb",
                   "why": "deadline" if hasattr(model, "generate_batch") else "no generate_batch"})
    else:
        try:
            emit(log, {"phase": "hf-cb", "preset": preset, **hf_continuous(model, requests)})
        except Exception as exc:
            traceback.print_exc()
            emit(log, {"phase": "hf-cb-failed", "preset": preset, "error": repr(exc)})
    del model
    torch.cuda.empty_cache()


def hf_static(model, requests) -> dict:
    """One left-padded batch of all the requests; every row runs to the longest output (that is
    what a static batch costs); useful tokens = each request's own output length."""
    import torch

    prompts = [r.prompt_token_ids for r in requests]
    width = max(len(x) for x in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(prompts):
        ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    new = max(r.params.max_tokens for r in requests)
    with torch.no_grad():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False,
                       pad_token_id=0)  # warm-up
        _sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        _sync()
        wall = time.perf_counter() - t0
    useful = sum(r.params.max_tokens for r in requests)
    return {"num_requests": len(requests), "batch_size": len(requests), "wall_s": wall,
            "generated_per_row": int(out.shape[1] - width), "useful_output_tokens": useful,
            "output_tokens_per_s": useful / wall,
            "total_tokens_per_s": (useful + sum(len(x) for x in prompts)) / wall,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


def hf_continuous(model, requests) -> dict:
    """transformers' generate_batch (paged attention, continuous batching). It takes one
    max_new_tokens for all, so every request generates the workload's mean output length."""
    import torch
    from transformers import GenerationConfig

    prompts = [r.prompt_token_ids for r in requests]
    new = round(sum(r.params.max_tokens for r in requests) / len(requests))
    for impl in ("sdpa_paged", "paged|sdpa"):
        try:
            model.set_attn_implementation(impl)
            break
        except Exception:
            continue
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    _sync()
    t0 = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    _sync()
    wall = time.perf_counter() - t0
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {"num_requests": len(requests), "max_new_tokens": new, "wall_s": wall,
            "output_tokens": generated, "output_tokens_per_s": generated / wall,
            "total_tokens_per_s": (generated + sum(len(x) for x in prompts)) / wall,
            "attn_implementation": str(getattr(model.config, "_attn_implementation", "?"))}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def print_table(log: Path) -> None:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    print("\n| preset | system | requests | out tok/s | total tok/s | wall s | max seqs | KV util | preempt |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["phase"] == "ours":
            print(f"| {r['preset']} | offline-paged {r['kv_layout']} | {r['num_requests']} | "
                  f"{r['output_tokens_per_s']:,.0f} | {r['total_tokens_per_s']:,.0f} | {r['wall_s']:.1f} | "
                  f"{r['max_concurrent_seqs']} | {r['kv_utilization']:.1%} | {r['num_preemptions']} |")
        elif r["phase"] in ("hf-static", "hf-cb"):
            print(f"| {r['preset']} | HF {r['phase'][3:]} | {r['num_requests']} | {r['output_tokens_per_s']:,.0f} | "
                  f"{r['total_tokens_per_s']:,.0f} | {r['wall_s']:.1f} | | | |")
        elif r["phase"] != "ceilings":
            print(f"| {r.get('preset', '')} | {r['phase']} {r.get('layout', r.get('what', ''))} | "
                  f"{r.get('why', r.get('error', ''))[:60]} | | | | | | |")


if __name__ == "__main__":
    sys.exit(main())
