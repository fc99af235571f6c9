"""Tensor parallelism: rank 0's group, the other ranks' processes and their collectives."""
