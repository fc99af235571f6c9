# vLLM's offline embedding example: a pooling runner, LLM.embed, outputs.embedding.
# expect: ok
from offline_paged import LLM


def main():
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    llm = LLM(model="TinyOrg/tiny-chat", runner="pooling", enforce_eager=True, trust_remote_code=True)
    outputs = llm.embed(prompts)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for prompt, output in zip(prompts, outputs):
        embeds = output.outputs.embedding
        embeds_trimmed = (str(embeds[:4])[:-1] + ", ...]") if len(embeds) > 4 else embeds
        print(f"Prompt: {prompt!r} \nEmbeddings: {embeds_trimmed} (size={len(embeds)})")
        print("-" * 60)
        assert abs(sum(x * x for x in embeds) - 1.0) < 1e-4  # normalised
    pooled = llm.encode(prompts, pooling_task="embed")
    assert pooled[0].outputs.data.shape == (len(outputs[0].outputs.embedding),)
    print("ok")


if __name__ == "__main__":
    main()
