"""StatsTracker: accumulates the engine's counters step by step and snapshots them as EngineStats.

KV utilization of a step = BlockManager.utilization: token slots in use / slots of the device
blocks resident sequences hold (a shared block counts once). It measures internal fragmentation,
the waste paging exists to bound: one part-filled block per sequence at most. Block usage = blocks
held / pool size.

BlockManager.utilization walks every table entry (O(blocks held), ~14k entries at 256 sequences);
measured every step it cost more host time than the scheduler. BlockManager.slot_utilization gets the
same figure from the blocks that can be part-filled alone: held blocks come from the free count, and only
the entries at or past a sequence's last reserved slot (one per sequence in the paged layout) are looked at.
"""
from __future__ import annotations

from offline_paged.core.outputs import EngineStats
from offline_paged.core.sequence import SequenceGroup


class StatsTracker:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.num_steps = 0
        self.num_requests_finished = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_preemptions_recompute = 0
        self.num_preemptions_swap = 0
        self._utilization = (0.0, 0.0)  # (slot utilization, block usage) of the latest step
        self._utilization_sums = [0.0, 0.0]
        self._block_usage_peak = 0.0

    def record_schedule(self, output, scheduler) -> None:
        """After schedule(): preemptions and the KV occupancy this step's forward will see."""
        self.num_preemptions_recompute += output.num_preempted_recompute
        self.num_preemptions_swap += output.num_preempted_swap
        if output.is_empty:
            return
        self.num_steps += 1
        self._utilization = self._measure(scheduler)
        self._utilization_sums[0] += self._utilization[0]
        self._utilization_sums[1] += self._utilization[1]
        self._block_usage_peak = max(self._block_usage_peak, self._utilization[1])

    def _measure(self, scheduler) -> tuple[float, float]:
        manager = scheduler.block_manager
        in_use = manager.num_gpu_blocks - manager.num_free_blocks
        return manager.slot_utilization(), in_use / manager.num_gpu_blocks

    def record_postprocess(self, num_samples: int) -> None:
        """After a step's results are processed: num_samples tokens were sampled (dropped lookahead ones too)."""
        self.num_generated_tokens += num_samples

    def record_finished(self, group: SequenceGroup) -> None:
        self.num_requests_finished += 1
        self.num_prompt_tokens += len(group.prompt_token_ids)

    def snapshot(self, scheduler) -> EngineStats:
        steps = max(self.num_steps, 1)
        manager = scheduler.block_manager
        return EngineStats(
            num_requests_finished=self.num_requests_finished,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_cached_prompt_tokens=manager.num_prefix_hit_tokens,
            prefix_cache_hit_rate=manager.prefix_cache_hit_rate,
            num_preemptions_recompute=self.num_preemptions_recompute,
            num_preemptions_swap=self.num_preemptions_swap,
            kv_utilization_current=self._utilization[0],
            kv_utilization_average=self._utilization_sums[0] / steps,
            kv_block_usage_current=self._utilization[1],
            kv_block_usage_average=self._utilization_sums[1] / steps,
            kv_block_usage_peak=self._block_usage_peak,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size=self.block_size,
            num_steps=self.num_steps,
        )


def combine_stats(snapshots: list[EngineStats]) -> EngineStats:
    """Several engines' stats as one (data parallel): counts and pools add up; rates and
    occupancies are averaged over engines, peaks take the largest; the hit rate is recomputed."""
    if not snapshots:
        return EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0)

    def total(name: str) -> int:
        return sum(getattr(s, name) for s in snapshots)

    def mean(name: str) -> float:
        return sum(getattr(s, name) for s in snapshots) / len(snapshots)

    looked_up = sum(s.num_cached_prompt_tokens / s.prefix_cache_hit_rate
                    for s in snapshots if s.prefix_cache_hit_rate)
    return EngineStats(
        num_requests_finished=total("num_requests_finished"),
        num_prompt_tokens=total("num_prompt_tokens"),
        num_generated_tokens=total("num_generated_tokens"),
        num_cached_prompt_tokens=total("num_cached_prompt_tokens"),
        prefix_cache_hit_rate=total("num_cached_prompt_tokens") / looked_up if looked_up else 0.0,
        num_preemptions_recompute=total("num_preemptions_recompute"),
        num_preemptions_swap=total("num_preemptions_swap"),
        kv_utilization_current=mean("kv_utilization_current"),
        kv_utilization_average=mean("kv_utilization_average"),
        kv_block_usage_current=mean("kv_block_usage_current"),
        kv_block_usage_average=mean("kv_block_usage_average"),
        kv_block_usage_peak=max(s.kv_block_usage_peak for s in snapshots),
        num_gpu_blocks=total("num_gpu_blocks"),
        num_cpu_blocks=total("num_cpu_blocks"),
        block_size=snapshots[0].block_size,
        num_steps=max(s.num_steps for s in snapshots),
    )
