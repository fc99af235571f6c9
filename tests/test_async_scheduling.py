"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) gives exactly
the outputs of the synchronous loop, on random workloads through the real engine on the CPU.

The CPU backend computes a step at launch, but the engine does not look at its tokens until the next
step has been scheduled and launched: every sequence in a decode step is rescheduled with its token
pending, the token reaches the next step's input ids through the runner's device-side gather (numpy
here), and sequences that turn out finished (eos, stop ids, stop strings, max_tokens, max_model_len)
drop their lookahead token. Preemption (recompute and swap) under a tiny pool, prefix-cache hits, n > 1
and penalties (which fall back to the synchronous path) are all in the mix.
"""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from tiny_engine import EOS_ID, run_to_completion, tiny_engine, tiny_model

from offline_paged.core.sampling_params import SamplingParams

MODEL = tiny_model(seed=3)
SHARED = [40, 41, 42, 43, 44, 45, 46, 47]


def _params(draw) -> SamplingParams:
    kind = draw(st.sampled_from(["greedy", "seeded", "stops", "n", "penalty", "logprobs", "prompt_logprobs"]))
    max_tokens = draw(st.integers(1, 14))
    base = dict(max_tokens=max_tokens, temperature=0.0 if kind == "greedy" else 0.9,
                seed=draw(st.integers(0, 5)))
    if kind == "stops":
        base |= dict(stop_token_ids=[draw(st.integers(4, 60))], stop=[draw(st.sampled_from(["a", "0", "z"]))],
                     min_tokens=draw(st.integers(0, max_tokens)))
    elif kind == "n":
        base |= dict(n=draw(st.integers(2, 3)))
    elif kind == "penalty":
        base |= dict(repetition_penalty=1.3, presence_penalty=0.5)
    elif kind == "logprobs":
        base |= dict(logprobs=2, ignore_eos=draw(st.booleans()))
    elif kind == "prompt_logprobs":
        base |= dict(prompt_logprobs=1, logprobs=1)
    return SamplingParams(**base)


@st.composite
def workloads(draw):
    requests = {}
    for index in range(draw(st.integers(1, 7))):
        prompt = draw(st.lists(st.integers(4, 250), min_size=1, max_size=12))
        if draw(st.booleans()):
            prompt = SHARED + prompt  # prefix-cache hits across requests
        requests[f"r{index}"] = (prompt, _params(draw))
    pool = draw(st.sampled_from([(256, "recompute"), (14, "recompute"), (14, "swap")]))
    return requests, pool


def _outputs(results: dict) -> dict:
    return {rid: ([(c.token_ids, c.finish_reason, c.stop_reason, c.text,
                    None if c.logprobs is None else [sorted(e) for e in c.logprobs]) for c in out.outputs],
                  None if out.prompt_logprobs is None else [e and sorted(e) for e in out.prompt_logprobs])
            for rid, out in results.items()}


def _run(requests, pool, async_scheduling: bool, max_model_len: int = 40):
    num_blocks, mode = pool
    engine = tiny_engine(MODEL, num_kv_blocks=num_blocks, num_cpu_blocks=64, preemption_mode=mode,
                         max_num_seqs=6, max_num_batched_tokens=24, max_model_len=max_model_len,
                         async_scheduling=async_scheduling)
    results = run_to_completion(engine, requests)
    assert engine.block_manager.num_seqs == 0, "blocks left behind"
    assert engine.block_manager.num_free_blocks == num_blocks
    return _outputs(results), engine


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_async_outputs_equal_the_synchronous_loop(workload):
    requests, pool = workload
    expected, _ = _run(requests, pool, async_scheduling=False)
    got, _ = _run(requests, pool, async_scheduling=True)
    assert got == expected


def test_lookahead_tokens_of_finished_sequences_are_dropped():
    """Stop ids come early for most rows: the async loop computed one more token for them, never shown."""
    stop_ids = list(range(4, 100)) + [EOS_ID]
    requests = {f"r{i}": ([60 + i, 70, 80], SamplingParams(max_tokens=30, temperature=0.8, seed=i,
                                                            stop_token_ids=stop_ids)) for i in range(6)}
    expected, _ = _run(requests, (256, "recompute"), async_scheduling=False, max_model_len=64)
    got, engine = _run(requests, (256, "recompute"), async_scheduling=True, max_model_len=64)
    assert got == expected
    assert any(reason == "stop" for outs, _ in got.values() for _, reason, *_ in outs), "no early stop drawn"
    assert engine.async_scheduling


def test_async_steps_overlap_scheduling_with_the_previous_step():
    """In a steady decode, each step's report comes back while the previous step's outputs are the ones
    processed: the first decode step returns nothing although a request finished in it."""
    engine = tiny_engine(MODEL, async_scheduling=True)
    engine.add_request("a", prompt_token_ids=[50, 51], params=SamplingParams(max_tokens=1, ignore_eos=True))
    first, _ = engine.step_with_report()  # prefill + sample of the only token: held in flight
    assert first == [] and engine.has_unfinished_requests()
    second, report = engine.step_with_report()  # nothing left to schedule; the previous step is processed
    assert [o.request_id for o in second] == ["a"] and report.scheduled == []
    assert not engine.has_unfinished_requests()
