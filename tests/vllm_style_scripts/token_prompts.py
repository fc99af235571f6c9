# vLLM's inputs / outputs modules: prompts as token ids, typed outputs, prompt log-probabilities.
# expect: ok
from offline_paged.inputs import TextPrompt, TokensPrompt
from offline_paged.outputs import CompletionOutput, RequestOutput

from offline_paged import LLM, SamplingParams


def main():
    llm = LLM(model="TinyOrg/tiny-chat", enable_prefix_caching=True)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Tokens in, tokens out")
    prompts = [TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="Text in, tokens out")]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1))
    for output in outputs:
        assert isinstance(output, RequestOutput) and isinstance(output.outputs[0], CompletionOutput)
        print(output.prompt_token_ids[:4], "->", output.outputs[0].token_ids)
        assert output.prompt_logprobs[0] is None
    assert outputs[0].prompt_token_ids == ids
    print("ok")


if __name__ == "__main__":
    main()
