"""TensorParallelExecutor: this process is rank 0 of N (scheduler, block manager, sampling, shard 0); a
TensorParallelGroup (offline_paged/tp/) runs ranks 1..N-1, which replay every step rank 0's runner sends
them (its mirror). Steps run synchronously: the other ranks need each step's inputs on the host."""
from __future__ import annotations

from offline_paged.core.config import EngineConfig
from offline_paged.executor.executor import Executor
from offline_paged.tp.tp_group import TensorParallelGroup
from offline_paged.worker.model_runner import ModelRunner
from offline_paged.worker.sampler import Sampler


class TensorParallelExecutor(Executor):
    """Spawns the other ranks and loads shard 0. loaded_model: a loaded model or a shard source
    (models/tp_source.py, e.g. a DummySource); None: config.model. Raises ValueError for async
    scheduling (before anything loads) and for a split that does not divide."""

    supports_async_scheduling = False  # the other ranks would need the sampled ids on their devices

    def __init__(self, config: EngineConfig, backend, loaded_model=None) -> None:
        if config.async_scheduling:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1 (the other "
                             "ranks would need the sampled ids on their devices); leave it unset or False")
        super().__init__(config, backend)
        self.group = None
        self.model, source = self._start(loaded_model)
        self.model_config, self.tokenizer = source.config, source.tokenizer

    def _start(self, loaded_model):
        """(rank 0's Llama over shard 0, the shard source): spawns the other ranks first."""
        from offline_paged.models.llama import Llama
        from offline_paged.models.tp_source import as_source

        source = as_source(loaded_model, self.config.model)
        self.group = group = TensorParallelGroup(self.config, source, self.backend)
        try:
            model = Llama(group.local_config, group.weights, self.backend.ops, self.backend.dtype,
                          max_positions=self.config.max_num_batched_tokens, tp=group.shard,
                          consume_weights=True)
        except BaseException:
            group.close()
            raise
        group.weights = None
        return model, source

    def usable_kv_memory(self, num_tokens: int, eos_token_ids: tuple[int, ...]) -> int:
        """The smallest of every rank's usable KV bytes: the profiling forward has collectives, so every
        rank runs it."""
        config = self.config
        self.group.start_profile(num_tokens, config.max_num_seqs, config.block_size)
        usable = super().usable_kv_memory(num_tokens, eos_token_ids)
        return min(usable, self.group.finish_profile())

    def init_runner(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int,
                    sampler: Sampler, max_num_seqs: int) -> ModelRunner:
        """Every rank builds its runner with rank 0's block counts. The decode graphs stay captured on first
        use: every rank must warm up and capture a bucket together (the all-reduces run in the warm-up)."""
        self.model.set_max_positions(max_model_len)
        self.group.init_runners(num_gpu_blocks, num_cpu_blocks, max_model_len, max_num_seqs)
        self.runner = self._make_runner(num_gpu_blocks, num_cpu_blocks, max_model_len, sampler, max_num_seqs,
                                        mirror=self.group)
        self.group.wait_ready()
        return self.runner

    def check_embeddings(self) -> None:
        raise ValueError("embeddings are not supported with tensor_parallel_size > 1")

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        if self.group is not None:
            self.group.close()
