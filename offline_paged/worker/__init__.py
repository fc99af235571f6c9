"""The runner: step inputs, the model runner, CUDA graphs and the samplers."""
