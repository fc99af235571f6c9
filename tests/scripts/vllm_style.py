"""A script written as for vLLM (only the import line names offline_paged). Usage: vllm_style.py MODEL_DIR.
It checks what it reads and exits non-zero on the first surprise."""
import sys

from offline_paged import (LLM, BeamSearchParams, CompletionOutput, Logprob, RequestOutput, SamplingParams,
                           TokensPrompt)

llm = LLM(model=sys.argv[1], dtype="auto", seed=0, enforce_eager=True, tensor_parallel_size=1,
          trust_remote_code=False, max_model_len=128, gpu_memory_utilization=0.9, enable_prefix_caching=True)
tokenizer = llm.get_tokenizer()

prompts = ["Hello, my name is", "The future of AI is"]
sampling_params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2,
                                 stop_token_ids=[tokenizer.eos_token_id])
outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
for prompt, output in zip(prompts, outputs):
    assert isinstance(output, RequestOutput) and output.prompt == prompt
    assert output.prompt_token_ids == tokenizer.encode(prompt)
    completion = output.outputs[0]
    assert isinstance(completion, CompletionOutput) and completion.finish_reason in ("stop", "length")
    for token_id, top in zip(completion.token_ids, completion.logprobs):
        chosen = top[token_id]
        assert isinstance(chosen, Logprob) and chosen.logprob <= 0.0
        assert chosen.decoded_token == tokenizer.decode([token_id])
        assert chosen.rank == 1  # greedy picks the most likely token
        assert sorted(lp.rank for lp in top.values()) == [1, 2, 3]
    assert output.prompt_logprobs[0] is None
    for token_id, top in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert token_id in top and all(lp.logprob <= 0.0 for lp in top.values())
    print(f"{prompt!r} -> {completion.text!r}")

ids = tokenizer.encode("Scoring a prompt from its token ids")
scored = llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)[0]
print("prompt logprob sum", sum(top[t].logprob for t, top in zip(ids[1:], scored.prompt_logprobs[1:])))

messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
chat = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
assert chat[0].prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
print("chat ->", repr(chat[0].outputs[0].text))

beams = llm.beam_search([{"prompt": "Once upon a time"}], BeamSearchParams(beam_width=3, max_tokens=5))
sequences = beams[0].sequences
assert len(sequences) == 3 and sequences[0].cum_logprob / len(sequences[0].tokens) >= \
    sequences[-1].cum_logprob / len(sequences[-1].tokens)
print("beam ->", [s.text for s in sequences])
print("ok")
