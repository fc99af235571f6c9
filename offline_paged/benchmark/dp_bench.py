"""The throughput benchmark over data-parallel workers: one workload dealt dynamically to N engine
processes by a DataParallelCoordinator, timed from the first request dealt to the last result back.

The workers warm up before they say ready, so the timing covers generation only. Per-step series
are not recorded (the steps run in the workers); the result carries the aggregate figures that the
comparison with one engine needs: wall time, prompt and output tokens, preemptions.
"""
from __future__ import annotations

import time

from offline_paged.benchmark.bench import BenchRequest, BenchResult
from offline_paged.core.outputs import RequestError


def run_data_parallel_bench(coordinator, requests: list[BenchRequest], *, label: str,
                            kv_layout: str, block_size: int) -> BenchResult:
    """Deal every request, collect every result; RuntimeError if a worker refuses one."""
    preemptions_before = coordinator.stats.num_preemptions
    num_prompt = num_output = 0
    start = time.perf_counter()
    for index, request in enumerate(requests):
        coordinator.add_request(f"bench-{index}", prompt_token_ids=request.prompt_token_ids,
                                params=request.params)
    while coordinator.has_unfinished_requests():
        for output in coordinator.step():
            if isinstance(output, RequestError):
                raise RuntimeError(f"{output.request_id}: {output.message}")
            num_prompt += len(output.prompt_token_ids)
            num_output += sum(len(c.token_ids) for c in output.outputs)
    wall = time.perf_counter() - start
    stats = coordinator.stats
    return BenchResult(
        label=label, kv_layout=kv_layout, block_size=block_size, num_requests=len(requests),
        num_prompt_tokens=num_prompt, num_output_tokens=num_output, wall_s=wall,
        num_gpu_blocks=stats.num_gpu_blocks, max_model_len=coordinator.max_model_len,
        num_preemptions=stats.num_preemptions - preemptions_before, peak_device_memory=None,
        ceilings=None)
