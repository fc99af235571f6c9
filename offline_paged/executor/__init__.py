"""The executor layer: the seam between the engine and the workers (vLLM's). The engine hands it each step's
SchedulerOutput; a LocalExecutor runs it on this process's runner, a TensorParallelExecutor on rank 0's
runner while the other ranks replay it. Nothing above this layer knows about tensor parallelism."""
