"""The public API on top of the engine: LLM, its arguments, prompts, lm-eval."""
