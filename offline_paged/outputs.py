"""vLLM's module path `vllm.outputs`: `from offline_paged.outputs import RequestOutput, CompletionOutput`."""
from offline_paged.core.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from offline_paged.entrypoints.pooling_outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                                       PoolingRequestOutput)

__all__ = ["RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput", "BeamSearchSequence",
           "EmbeddingOutput", "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput"]
