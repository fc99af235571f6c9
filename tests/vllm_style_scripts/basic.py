# Written the way vLLM's offline "basic" example reads; only the import line names offline_paged.
# expect: ok
from offline_paged import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7)


def main():
    llm = LLM(model="TinyOrg/tiny-chat")
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    assert [o.prompt for o in outputs] == prompts
    print("ok")


if __name__ == "__main__":
    main()
