"""Structured-output masks on the GPU (needs a GPU; no llguidance: the masks are random packed bitmasks).

The apply_token_bitmask kernel equals the NumPy mask application (sampler.apply_token_bitmasks) bit for bit,
and masked device sampling (GpuSampler) draws what the host Sampler draws, never a masked token."""
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
