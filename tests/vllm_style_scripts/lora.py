# vLLM's multi-LoRA example in short: building a LoRARequest works; using it is refused (no LoRA here).
# expect: not supported: lora_request is not supported
from offline_paged.lora.request import LoRARequest

from offline_paged import LLM, SamplingParams


def main():
    llm = LLM(model="TinyOrg/tiny-chat", enable_lora=False, max_model_len=128)
    lora = LoRARequest("sql-lora", 1, "/adapters/sql-lora")
    print(lora.lora_name, lora.lora_int_id)
    llm.generate(["[user] Write a SQL query [/user] [assistant]"], SamplingParams(temperature=0.0, max_tokens=8),
                 lora_request=lora)


if __name__ == "__main__":
    main()
