"""The executor seam (offline_paged/executor/): the engine gets a LocalExecutor for one process and a
TensorParallelExecutor otherwise, and every step goes through `execute`. The tensor-parallel protocol's
step message is checked without processes: a second runner that only replays the MirroredSteps rank 0's
runner sends ends with rank 0's KV cache, over eager and empty steps, prefix hits and preemption.
Spawned CPU ranks run in test_tensor_parallel_engine.py."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine
from offline_paged.executor.executor import Executor
from offline_paged.executor.local_executor import LocalExecutor
from offline_paged.worker.mirrored_step import EagerForward, MirroredStep
from offline_paged.worker.model_runner import ModelRunner
from tiny_engine import run_to_completion, tiny_model


def _config(**overrides) -> EngineConfig:
    return EngineConfig(**(dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=24, max_num_seqs=4,
                                max_num_batched_tokens=32) | overrides))


class _Recorder:
    """A mirror that keeps what rank 0's runner sends."""

    def __init__(self) -> None:
        self.steps: list[MirroredStep] = []

    def send_step(self, step: MirroredStep) -> None:
        self.steps.append(step)


def test_one_process_gets_the_local_executor_and_steps_through_it():
    engine = LLMEngine(_config(), loaded_model=tiny_model())
    assert isinstance(engine.executor, LocalExecutor) and engine.executor.runner is engine.runner
    assert engine.executor.supports_async_scheduling
    calls = []
    execute = engine.executor.execute
    engine.executor.execute = lambda output, in_flight, **kw: calls.append(output) or execute(output, in_flight, **kw)
    run_to_completion(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))})
    assert len(calls) >= 3 and all(c.scheduled for c in calls)


def test_tensor_parallel_refuses_async_scheduling_before_loading_anything():
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the model was touched ({name}) before the config was checked")

    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor_parallel_size"):
        Executor.create(_config(tensor_parallel_size=2, async_scheduling=True), backend=None,
                        kv_cache_dtype="auto", loaded_model=Untouchable())


def test_a_runner_replaying_the_mirrored_steps_ends_with_rank_0s_kv_cache():
    engine = LLMEngine(_config(num_kv_blocks=14, num_cpu_blocks=16, preemption_mode="swap"),
                       loaded_model=tiny_model())
    recorder = _Recorder()
    engine.runner.mirror = recorder
    engine.runner.table_rows.track_mirror = True
    rng = np.random.default_rng(0)
    prefix = rng.integers(4, 260, size=8).tolist()
    requests = {f"r{i}": (prefix + rng.integers(4, 260, size=3 + i).tolist(),
                          SamplingParams(max_tokens=12, temperature=0.0)) for i in range(5)}
    run_to_completion(engine, requests)
    assert engine.stats.num_preemptions > 0  # swaps crossed too
    assert any(isinstance(s.forward, EagerForward) for s in recorder.steps)
    assert all(isinstance(s, MirroredStep) for s in recorder.steps)
    replica = ModelRunner(engine.runner.model, engine.backend, engine.num_gpu_blocks, engine.runner.num_cpu_blocks,
                          engine.config.block_size, max_model_len=engine.max_model_len)
    for step in recorder.steps:
        replica.run_mirrored(step)
    np.testing.assert_array_equal(replica.kv_cache, engine.runner.kv_cache)
