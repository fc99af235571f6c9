# vLLM's module paths: SamplingParams and BeamSearchParams from the sampling_params module.
# expect: ok
from offline_paged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

from offline_paged import LLM


def main():
    llm = LLM(model="TinyOrg/tiny-chat", max_model_len=128, enforce_eager=True)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = llm.beam_search([{"prompt": "Once upon a time"}, {"prompt": "In a galaxy"}], params)
    for output in outputs:
        for sequence in output.sequences:
            print(f"{sequence.text!r} cum_logprob={sequence.cum_logprob:.3f}")
    assert len(outputs) == 2 and all(len(o.sequences) == 3 for o in outputs)
    assert RequestOutputKind.FINAL_ONLY.name == "FINAL_ONLY"  # offline generation hands out final outputs
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    print(llm.generate("Once upon a time", greedy)[0].outputs[0].text)
    print("ok")


if __name__ == "__main__":
    main()
