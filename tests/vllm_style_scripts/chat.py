# The shape of vLLM's offline chat example: LLM.chat with a conversation, a batch of them, content parts.
# expect: ok
from offline_paged import LLM, SamplingParams


def print_outputs(outputs):
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
    print("-" * 80)


def main():
    llm = LLM(model="TinyOrg/tiny-chat", seed=0)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens  # a script may read it
    sampling_params = SamplingParams(temperature=0.5, max_tokens=10)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]}]
    print_outputs(llm.chat(parts, sampling_params, chat_template_kwargs={"enable_thinking": False}))
    print("ok")


if __name__ == "__main__":
    main()
