"""LocalExecutor: the model, the runner and every step in this one process."""
from __future__ import annotations

from offline_paged.core.config import EngineConfig
from offline_paged.executor.executor import Executor
from offline_paged.ops.kv_scales import KV_CACHE_NUMPY_DTYPES
from offline_paged.worker.model_runner import ModelRunner
from offline_paged.worker.sampler import Sampler


class LocalExecutor(Executor):
    """Loads the model (unless given one: anything with .config, .weights, .tokenizer) into this process."""

    def __init__(self, config: EngineConfig, backend, kv_cache_dtype: str, loaded_model=None) -> None:
        super().__init__(config, backend)
        self.model, loaded_model = self._build_model(loaded_model, kv_cache_dtype)
        self.model_config, self.tokenizer = loaded_model.config, loaded_model.tokenizer

    def _build_model(self, loaded_model, kv_cache_dtype: str):
        """(Llama, loaded model). RoPE for the profiling step only (its positions stay below the token
        budget); rebuilt for max_model_len later, so a config's max_position_embeddings never sizes a
        table by itself."""
        from offline_paged.models.llama import Llama

        if loaded_model is None:
            from offline_paged.models.loader import load_model

            loaded_model = load_model(self.config.model)
        model = Llama(loaded_model.config, loaded_model.weights, self.backend.ops, self.backend.dtype,
                      max_positions=self.config.max_num_batched_tokens,
                      kv_cache_dtype=KV_CACHE_NUMPY_DTYPES[kv_cache_dtype],
                      calculate_kv_scales=self.config.calculate_kv_scales, quantization=self.config.quantization)
        return model, loaded_model

    def init_runner(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int,
                    sampler: Sampler, max_num_seqs: int) -> ModelRunner:
        """The runner, its decode and mixed-step graphs (if any) captured now, before the first step, and on
        CUDA the eager LM head's kernels loaded (CudaOps.warm_logits)."""
        runner = super().init_runner(num_gpu_blocks, num_cpu_blocks, max_model_len, sampler, max_num_seqs)
        if runner.decode_graphs is not None:
            runner.decode_graphs.capture_all(runner.sampling_rows)
        if runner.mixed_graphs is not None:
            runner.mixed_graphs.capture_all()
        if self.backend.name == "cuda":
            self.model.ops.warm_logits(self.model.lm_head, max_num_seqs)
        return runner
