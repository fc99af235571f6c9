"""vLLM's module path `vllm.inputs`: `from offline_paged.inputs import TokensPrompt, TextPrompt`."""
from offline_paged.entrypoints.inputs import TextPrompt, TokensPrompt

PromptType = str | TextPrompt | TokensPrompt | list[int]

__all__ = ["TextPrompt", "TokensPrompt", "PromptType"]
