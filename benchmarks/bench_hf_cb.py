"""transformers' continuous batching on the very workload `offline-paged bench` runs by default.

The same 256 requests (`random_workload` with bench's defaults and the preset's vocabulary), each with
its own max_new_tokens through the manager's `add_request`, EOS off so every request generates exactly
its drawn length. transformers gets its best settings where the installed version has them: CUDA
graphs and async batching (ContinuousBatchingConfig), the manager's own choice of paged attention, fp16, greedy decoding (cheaper
for it than our bench's temperature-1 sampling). Random weights: the throughput does not depend on them.

    python benchmarks/bench_hf_cb.py --preset llama-3.2-1b [--num-requests 256] [--no-cuda-graphs]

Prints one JSON record (output tok/s, wall, settings actually used). Needs torch with CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys
import dataclasses
import inspect
import json
import time

from offline_paged.benchmark.bench import random_workload
from offline_paged.models.dummy_weights import preset_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke check of this script")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every request's output (smoke)")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = preset_config(args.preset)
    requests = random_workload(args.num_requests, vocab_size=config.vocab_size, seed=args.seed)
    if args.max_tokens:
        requests = [type(r)(r.prompt_token_ids, dataclasses.replace(r.params, max_tokens=min(args.max_tokens, r.params.max_tokens), min_tokens=0))
                    for r in requests]
    cuda = args.device == "cuda"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**config.to_dict())).to(torch.float16 if cuda else torch.float32).eval()
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(r.params.max_tokens for r in requests))
    graphs = cuda and not args.no_cuda_graphs
    settings = {"use_cuda_graph": graphs, "use_async_batching": graphs}
    init_kwargs = {"generation_config": gen}
    cb_config_cls = getattr(transformers, "ContinuousBatchingConfig", None)
    if cb_config_cls is None:
        from transformers.generation import configuration_utils
        cb_config_cls = getattr(configuration_utils, "ContinuousBatchingConfig", None)
    init_params = inspect.signature(model.init_continuous_batching).parameters
    if cb_config_cls is not None and "continuous_batching_config" in init_params:
        accepted = inspect.signature(cb_config_cls).parameters
        init_kwargs["continuous_batching_config"] = cb_config_cls(
            **{k: v for k, v in settings.items() if k in accepted})
        used = {k: v for k, v in settings.items() if k in accepted}
    else:
        used = {k: v for k, v in settings.items() if k in init_params}
        init_kwargs.update(used)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run(manager, reqs, tag: str) -> tuple[float, int]:
        sync()
        t0 = time.perf_counter()
        pending = {manager.add_request(r.prompt_token_ids, request_id=f"{tag}{i}",
                                       max_new_tokens=r.params.max_tokens) for i, r in enumerate(reqs)}
        generated = 0
        while pending:
            result = manager.get_result(timeout=60)
            if result is None:
                status = getattr(manager, "background_thread_status", None)
                raise RuntimeError(f"transformers' manager stopped with {len(pending)} requests pending: "
                                   f"{getattr(status, 'fatal_error', None)!r}")
            finished = result.is_finished() if callable(getattr(result, "is_finished", None)) \
                else str(result.status).endswith("FINISHED")
            if result.request_id in pending and finished:
                pending.discard(result.request_id)
                generated += len(result.generated_tokens)
        sync()
        return time.perf_counter() - t0, generated

    # One manager for the warm-up (graph capture, allocator) and the measured run. The record is printed
    # before the manager is stopped: transformers 5.24's stop() was seen hanging in a destructor on this
    # CPU, so the process then leaves without waiting for it.
    ctx_params = inspect.signature(model.continuous_batching_context_manager).parameters
    ctx_kwargs = {k: v for k, v in init_kwargs.items() if k in ctx_params}
    context = model.continuous_batching_context_manager(block=False, **ctx_kwargs)
    with torch.no_grad():
        manager = context.__enter__()
        run(manager, requests[:4], "warm")
        wall, generated = run(manager, requests, "r")
    expected = sum(r.params.max_tokens for r in requests)
    print(json.dumps({
        "engine": f"transformers {transformers.__version__} continuous batching",
        "preset": args.preset, "num_requests": len(requests), "wall_s": round(wall, 3),
        "output_tokens": generated, "expected_output_tokens": expected,
        "output_tokens_per_s": round(generated / wall, 1),
        "total_tokens_per_s": round((generated + sum(len(r.prompt_token_ids) for r in requests)) / wall, 1),
        "settings": used, "attn_implementation": str(getattr(model.config, "_attn_implementation", "?")),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }), flush=True)
    sys.stderr.flush()
    os._exit(0)  # see above: never wait on the manager's stop


if __name__ == "__main__":
    raise SystemExit(main())
