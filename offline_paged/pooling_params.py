"""vLLM's module path `vllm.pooling_params`: `from offline_paged.pooling_params import PoolingParams`."""
from offline_paged.entrypoints.pooling_outputs import PoolingParams

__all__ = ["PoolingParams"]
