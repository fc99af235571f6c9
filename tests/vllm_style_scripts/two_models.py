# Two LLMs one after the other, freeing the first the way vLLM's examples do.
# expect: ok
import gc

from offline_paged.distributed import cleanup_dist_env_and_memory

from offline_paged import LLM, SamplingParams


def main():
    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(model="TinyOrg/tiny-chat", swap_space=1, gpu_memory_utilization=0.5)
    first = llm.generate(["A prompt"], params)[0].outputs[0].token_ids
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    llm = LLM(model="TinyOrg/tiny-chat", swap_space=1, gpu_memory_utilization=0.5)
    again = llm.generate(["A prompt"], params)[0].outputs[0].token_ids
    assert first == again, (first, again)
    print("ok")


if __name__ == "__main__":
    main()
