"""Structured-output masks on the GPU (needs a GPU; the sampler tests' masks are random packed bitmasks).

The apply_token_bitmask kernel equals the NumPy mask application (sampler.apply_token_bitmasks) bit for bit,
masked device sampling (GpuSampler) draws what the host Sampler draws, never a masked token, and a beam row
under a grammar ranks the host's allowed top-k; the CUDA engine's grammar beams equal the CPU engine's."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.ops import sampling_launcher as kernels  # noqa: E402
from offline_paged.worker.gpu_sampler import GpuSampler  # noqa: E402
from offline_paged.worker.sampler import (Sampler, SamplingRequest, apply_token_bitmasks,  # noqa: E402
                                          unpack_bitmask)


def _masks(rng, rows: int, vocab: int, density: float, words: int | None = None) -> np.ndarray:
    words = -(-vocab // 32) if words is None else words
    bits = rng.random((rows, words * 32)) < density  # [R, 32 W]
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [R, W]


@pytest.mark.parametrize("vocab, words", [(49152, None), (49155, None), (1000, 20), (77, 5)])
def test_the_mask_kernel_equals_the_numpy_application(vocab, words):
    rng = np.random.default_rng(vocab)
    adjusted = rng.standard_normal((6, vocab))  # [R, V] float64
    masks = _masks(rng, 4, vocab, 0.3, words)  # [Rm, W]: rows 0, 2, 3, 5 masked
    masked_rows = [0, 2, 3, 5]
    requests = [SamplingRequest(SamplingParams(), 0, 0, (), (), masks[masked_rows.index(r)] if r in masked_rows
                                else None) for r in range(6)]
    want = adjusted.copy()
    apply_token_bitmasks(want, requests)
    got = cupy.asarray(adjusted)
    kernels.apply_token_bitmask(got, cupy.asarray(np.array(masked_rows, np.int32)), cupy.asarray(masks))
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_the_launcher_refuses_a_mask_of_the_wrong_dtype():
    with pytest.raises(ValueError, match="bitmask must be int32"):
        kernels.apply_token_bitmask(cupy.zeros((1, 64)), cupy.zeros(1, cupy.int32), cupy.zeros((1, 2), cupy.int64))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=40),
                                    SamplingParams(temperature=1.2, min_p=0.05, logprobs=3)],
                         ids=["greedy", "random", "top_k+top_p", "min_p+logprobs"])
def test_masked_device_sampling_equals_the_host_reference(params):
    rng = np.random.default_rng(1)
    vocab, rows = 49152, 64
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)  # [R, V]
    masks = _masks(rng, rows, vocab, 0.02)
    masks[::7] = 0
    masks[::7, 0] = 1 << 5  # a row whose grammar allows one token only (id 5)
    requests = [SamplingRequest(params, 1000 + r, r, (1, 2), (), masks[r]) for r in range(rows)]
    want = Sampler((2,)).sample(logits, requests)
    got = GpuSampler((2,)).sample(cupy.asarray(logits), list(range(rows)), requests)
    allowed = unpack_bitmask(masks, vocab)
    assert all(allowed[r, g.token_id] for r, g in enumerate(got))
    assert [g.token_id for g in got] == [w.token_id for w in want]
    np.testing.assert_allclose([g.logprob for g in got], [w.logprob for w in want], rtol=0, atol=1e-4)
    assert all(got[r].token_id == 5 for r in range(0, rows, 7))


def test_grammar_steps_sample_in_the_decode_graph_and_after_the_matchers_advance_under_async():
    """Grammar rows on the GPU: the decode graph's masked sampler draws exactly what the eager GpuSampler
    draws from the same graphs' logits (sync loop, tokens and cumulative logprobs). Under async
    scheduling each grammar step's masks are filled after the previous step's tokens reached the
    matchers (launch_deferred_sampling), so every JSON output validates and a failing matcher ends only
    its request; the tokens equal the sync loop's up to fp16 near-ties between different batch shapes."""
    import json

    import jsonschema

    from offline_paged.core.config import EngineConfig
    from offline_paged.core.outputs import RequestError
    from offline_paged.engine import LLMEngine
    from tiny_engine import ByteTokenizer, run_to_completion, tiny_model

    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
        "type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["id", "tags"]}
    prompt = ByteTokenizer().encode("Answer: ")
    z = ByteTokenizer().encode("z")[0]

    def workload():
        requests = {f"j{i}": (prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                                     structured_outputs={"json": schema})) for i in range(12)}
        requests |= {f"f{i}": (prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True))
                     for i in range(4)}
        requests["doomed"] = (prompt, SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[z],
                                                     structured_outputs={"regex": "[0-9]+"}))
        return requests

    def engine(async_scheduling, graph_sampling=True):
        eng = LLMEngine(EngineConfig(device="cuda", dtype="float16", block_size=16, num_kv_blocks=256,
                                     max_num_seqs=32, async_scheduling=async_scheduling, cuda_graphs=True),
                        loaded_model=tiny_model(seed=5, hidden_size=128, intermediate_size=256,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=64))
        if not graph_sampling:  # the eager GpuSampler applies the masks to the same graphs' logits
            eng.runner.attach_decode_graphs(eng.runner.decode_graphs, sample_in_graph=False)
        return eng

    def tokens(outputs):
        return {k: v.message if isinstance(v, RequestError) else [c.token_ids for c in v.outputs]
                for k, v in outputs.items()}

    def logprobs(outputs):  # each engine tunes its GEMMs: logits may differ in the last bits between engines
        return np.array([c.cumulative_logprob for k, v in sorted(outputs.items())
                         if not isinstance(v, RequestError) for c in v.outputs])

    eager = run_to_completion(engine(False, graph_sampling=False), workload())
    sync_engine = engine(False)
    sync = run_to_completion(sync_engine, workload())
    assert sync_engine.runner.decode_graphs.num_sampled_replays > 0  # grammar rows sampled in the graph
    assert tokens(sync) == tokens(eager)  # the masked graph sampler draws what the eager one draws
    np.testing.assert_allclose(logprobs(sync), logprobs(eager), rtol=1e-6)
    eng = engine(True)
    deferred = []
    launch_deferred = eng.runner.launch_deferred_sampling
    eng.runner.launch_deferred_sampling = lambda launched: deferred.append(launched) or launch_deferred(launched)
    got = run_to_completion(eng, workload())
    assert len(deferred) > 10 and any(launched.used_cuda_graph for launched in deferred)
    assert isinstance(got["doomed"], RequestError) and "structured output failed" in got["doomed"].message
    same = 0
    for key, output in got.items():
        if key.startswith("j"):  # a mask filled from a stale matcher would end the request with an error
            assert not isinstance(output, RequestError), output.message
            if output.outputs[0].finish_reason != "length":
                jsonschema.validate(json.loads(output.outputs[0].text), schema)
        if key != "doomed":
            same += output.outputs[0].token_ids == sync[key].outputs[0].token_ids
    print(f"\n{same}/16 outputs identical to the sync loop's")
    assert same >= 12


def test_beam_rows_under_a_grammar_rank_the_same_allowed_tokens_as_the_host_sampler():
    """A beam row with a mask takes its top-k among its allowed tokens (fewer, or none, when fewer are
    allowed), as sampler.allowed_top_logprobs; other rows keep the raw top-k plus the chosen token."""
    rng = np.random.default_rng(2)
    vocab, rows = 49152, 12
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)  # [R, V]
    masks = _masks(rng, rows, vocab, 0.01)  # [R, W]
    masks[1] = 0  # nothing allowed: no candidate
    masks[2] = 0
    masks[2, 0], masks[2, 100] = 1 << 5, 1 << 7  # two tokens allowed (5 and 3207), fewer than k
    beam = SamplingParams(use_beam_search=True, temperature=0.0, n=4, logprobs=10)
    plain = SamplingParams(temperature=0.0, logprobs=3)
    requests = [SamplingRequest(beam, 0, 0, (1, 2), (), masks[r]) for r in range(8)]
    requests += [SamplingRequest(plain, 0, 0, (1, 2), (), masks[8]), SamplingRequest(beam, 0, 0, (1, 2), ()),
                 SamplingRequest(SamplingParams(temperature=0.0), 0, 0, (1, 2), (), masks[10]),
                 SamplingRequest(beam, 0, 0, (1, 2), (), masks[11])]
    want = Sampler((2,)).sample(logits, requests)
    got = GpuSampler((2,)).sample(cupy.asarray(logits), list(range(rows)), requests)
    assert got[1].top_logprobs == {} and sorted(got[2].top_logprobs) == [5, 3207]
    allowed = unpack_bitmask(masks, vocab)  # [R, V]
    for r, (g, w) in enumerate(zip(got, want)):
        if r != 1:  # (row 1 allows nothing: its greedy "token" is arbitrary, and no beam candidate)
            assert g.token_id == w.token_id
        if w.top_logprobs is None:
            assert g.top_logprobs is None
            continue
        assert set(g.top_logprobs) == set(w.top_logprobs), r
        np.testing.assert_allclose([g.top_logprobs[t] for t in w.top_logprobs], list(w.top_logprobs.values()),
                                   rtol=0, atol=1e-4)
        values = list(g.top_logprobs.values())
        assert values == sorted(values, reverse=True)
        if requests[r].params.use_beam_search and requests[r].token_bitmask is not None:
            assert all(allowed[r, t] for t in g.top_logprobs)


def test_cuda_beams_under_a_grammar_equal_the_cpu_engine_beams():
    """Beam search with grammars on the CUDA engine (fp16; beam rows take the eager GpuSampler's masked
    top-k) against the CPU engine (float64) on the same random weights. A choice list with beam_width above
    its size returns every choice on both, each with the same cumulative logprob up to fp16 noise, ranked
    alike wherever the CPU's scores are apart by more than that noise; JSON and regex beams all validate."""
    import json
    import re

    import jsonschema

    from offline_paged.core.config import EngineConfig
    from offline_paged.core.outputs import RequestError
    from offline_paged.engine import LLMEngine
    from tiny_engine import ByteTokenizer, run_to_completion, tiny_engine, tiny_model

    model = tiny_model(seed=5, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64)
    prompt = ByteTokenizer().encode("Colour and answer: ")
    choices = ["red", "green", "gr", "blue", "grey", "teal"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}

    def beam(width, spec, n=None):
        return SamplingParams(use_beam_search=True, temperature=0.0, n=n or width, best_of=width, max_tokens=60,
                              structured_outputs=spec)

    requests = {"choice": (prompt, beam(8, {"choice": choices})),
                "json": (prompt, beam(3, {"json": schema, "disable_any_whitespace": True})),
                "regex": (prompt, beam(4, {"regex": "(ab|c)[0-9]{1,2}"}, n=2))}
    gpu_engine = LLMEngine(EngineConfig(device="cuda", dtype="float16", block_size=16, num_kv_blocks=256,
                                        max_num_seqs=32, cuda_graphs=True), loaded_model=model)
    gpu = run_to_completion(gpu_engine, requests)
    cpu = run_to_completion(tiny_engine(model), requests)
    assert not any(isinstance(v, RequestError) for v in [*gpu.values(), *cpu.values()])

    def scores(output):  # text -> (cumulative logprob, beam_score)
        return {c.text: (c.cumulative_logprob, c.cumulative_logprob / (len(prompt) + len(c.token_ids)
                                                                        - c.finished_by_eos))
                for c in output.outputs}

    gpu_choice, cpu_choice = scores(gpu["choice"]), scores(cpu["choice"])
    assert sorted(gpu_choice) == sorted(cpu_choice) == sorted(choices)
    scale = max(abs(cum) for cum, _ in cpu_choice.values())
    tolerance = 2e-2 * scale  # fp16 noise on a sum of a few token logprobs (test_gpu_engine's bound)
    for text, (cum, _) in cpu_choice.items():
        assert abs(gpu_choice[text][0] - cum) < tolerance, (text, gpu_choice[text][0], cum)
    gpu_rank = [c.text for c in gpu["choice"].outputs]
    length = len(prompt)  # a lower bound of every hypothesis' length: score gaps at least this small
    for a, b in [(a, b) for a in choices for b in choices]:
        if cpu_choice[a][1] - cpu_choice[b][1] > 2 * tolerance / length:
            assert gpu_rank.index(a) < gpu_rank.index(b), (a, b)
    for key, check in (("json", lambda t: jsonschema.validate(json.loads(t), schema) or True),
                       ("regex", lambda t: re.fullmatch("(ab|c)[0-9]{1,2}", t))):
        texts = [c.text for c in gpu[key].outputs]
        assert len(set(texts)) == len(texts) == len(cpu[key].outputs)
        assert all(c.finish_reason == "stop" and check(c.text) for c in gpu[key].outputs), texts
