"""vLLM's `vllm.lora` package path; LoRA adapters are not supported yet (see lora/request.py)."""
