"""Executor: what the engine asks of the workers, whatever runs them (one process, or N tensor-parallel ranks).

Lifecycle, driven by the engine: `Executor.create` builds the model (loads it, or under tensor parallelism
spawns the other ranks and loads shard 0); `usable_kv_memory` profiles the largest step (CUDA, when the
KV pool is sized from memory); `init_runner` builds the ModelRunner and its KV pools; then `execute` once
per step; `close` at the end.
"""
from __future__ import annotations

from offline_paged.core.config import EngineConfig
from offline_paged.worker.launched_step import LaunchedStep
from offline_paged.worker.model_runner import ModelRunner, profile_step_memory
from offline_paged.worker.sampler import Sampler


class Executor:
    """The runner of this process and whatever must happen on other processes in step with it.

    After construction: `model` (this process's Llama: the whole model, or shard 0), `model_config` (the
    whole model's config), `tokenizer`. After `init_runner`: `runner`. Subclasses build the model and may
    override the hooks; the base runs everything on this process."""

    supports_async_scheduling = True  # whether the next step may be launched before this one's tokens are known

    def __init__(self, config: EngineConfig, backend) -> None:
        self.config = config
        self.backend = backend
        self.model = None
        self.model_config = None
        self.tokenizer = None
        self.runner: ModelRunner | None = None
        self.profiled_activation_bytes: int | None = None  # set by usable_kv_memory

    @staticmethod
    def create(config: EngineConfig, backend, kv_cache_dtype: str, loaded_model=None) -> Executor:
        """The executor `config` asks for: tensor parallel when tensor_parallel_size > 1, else local.
        loaded_model: an already-loaded model (or, for tensor parallelism, a shard source); None loads
        config.model (or the default model)."""
        if config.tensor_parallel_size > 1:
            from offline_paged.executor.tp_executor import TensorParallelExecutor

            return TensorParallelExecutor(config, backend, loaded_model)
        from offline_paged.executor.local_executor import LocalExecutor

        return LocalExecutor(config, backend, kv_cache_dtype, loaded_model)

    def usable_kv_memory(self, num_tokens: int, eos_token_ids: tuple[int, ...]) -> int:
        """Bytes the KV pool may take on CUDA: free memory after the weights x gpu_memory_utilization, less
        the activations of the largest step (`num_tokens` tokens over max_num_seqs sequences), measured by
        a profiling forward (`profile_step_memory`)."""
        config = self.config
        activations = profile_step_memory(self.model, self.backend, num_tokens, config.max_num_seqs,
                                          config.block_size, eos_token_ids)
        self.profiled_activation_bytes = activations
        return int(self.backend.free_memory_bytes() * config.gpu_memory_utilization) - activations

    def init_runner(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int,
                    sampler: Sampler, max_num_seqs: int) -> ModelRunner:
        """Build the runner (and its KV pools) for sequences up to max_model_len tokens and steps of up to
        max_num_seqs sequences (the engine's, which may be below the profiled config's: fit_max_num_seqs)."""
        self.model.set_max_positions(max_model_len)
        self.runner = self._make_runner(num_gpu_blocks, num_cpu_blocks, max_model_len, sampler, max_num_seqs)
        return self.runner

    def _make_runner(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int, sampler: Sampler,
                     max_num_seqs: int, mirror=None) -> ModelRunner:
        config = self.config
        return ModelRunner(self.model, self.backend, num_gpu_blocks, num_cpu_blocks, config.block_size, sampler,
                           cuda_graphs=config.cuda_graphs, max_model_len=max_model_len, mirror=mirror,
                           max_num_seqs=max_num_seqs,
                           mixed_graph_tokens=min(config.mixed_graph_tokens, config.max_num_batched_tokens))

    def execute(self, output, in_flight: LaunchedStep | None = None,
                defer_grammar_sampling: bool = False) -> LaunchedStep:
        """Queue one step (ModelRunner.launch): its block moves, forward and sampling. in_flight: the
        launched step whose sampled tokens some of this step's inputs still wait for (async scheduling).
        defer_grammar_sampling: a step with structured-output rows comes back with its sampling deferred
        until `launch_deferred_sampling` (after the engine processed `in_flight`)."""
        return self.runner.launch(output, in_flight, defer_grammar_sampling)

    def launch_deferred_sampling(self, launched: LaunchedStep) -> LaunchedStep:
        """Fill the masks of a deferred grammar step and queue its sampling (ModelRunner's)."""
        return self.runner.launch_deferred_sampling(launched)

    def check_embeddings(self) -> None:
        """ValueError when this executor cannot run the pooling forward (engine.embed)."""

    def close(self) -> None:
        """Stop whatever runs outside this process (idempotent)."""
