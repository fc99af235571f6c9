"""CudaOps against NumpyOps, method by method, and the whole Llama forward: GPU fp16 and bf16 vs CPU fp32
on random weights of realistic shapes (teacher-forced next-token agreement and logits). Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.config import LlamaConfig
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner, build_metadata
from offline_paged.ops.ops_numpy import NumpyOps

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (bf16 arrays; a GPU run without it must fail, not skip)
pytestmark = pytest.mark.gpu

from fixtures_random_weights import random_weights  # noqa: E402,F401  (re-exported to the GPU tests)
from test_launchers import windowed_attention_reference  # noqa: E402

from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402  (needs cupy)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
OP_TOL = {np.dtype(np.float16): 1e-2, BF16: 2.5e-2}  # max |err| / max |ref| of one op

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5,
                     max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)
GQA4_D128_SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, rope_theta=5e5,
                       max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5)
# Qwen2: q/k/v biases. Qwen3: per-head q/k RMSNorm, head_dim 128 != hidden / heads, tied.
QWEN2_SHAPE = dict(architecture="Qwen2ForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                   rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
QWEN3_SHAPE = dict(architecture="Qwen3ForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                   num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6)


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_matches_numpy_ops(dtype):
    rng = np.random.default_rng(0)
    cuda, ref = CudaOps(), NumpyOps()
    tol = OP_TOL[dtype]
    f16 = lambda a: a.astype(dtype)  # noqa: E731  (the dtype under test)
    x, res, w = f16(rng.standard_normal((9, 576))), f16(rng.standard_normal((9, 576))), f16(1 + 0.1 * rng.standard_normal(576))
    for got, want in zip(cuda.rms_norm(cupy.asarray(x), cupy.asarray(w), 1e-5, cupy.asarray(res)),
                         ref.rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5, res.astype(np.float32))):
        assert rel_error(got.get(), want) < tol
    gate_up = f16(3 * rng.standard_normal((9, 64)))
    assert rel_error(cuda.silu_mul(cupy.asarray(gate_up)).get(), ref.silu_mul(gate_up.astype(np.float32))) < tol

    table = np.concatenate([np.cos(np.outer(np.arange(64), 0.1 ** np.arange(32) )),
                            np.sin(np.outer(np.arange(64), 0.1 ** np.arange(32)))], axis=1)
    q, k, pos = f16(rng.standard_normal((9, 4, 64))), f16(rng.standard_normal((9, 2, 64))), rng.integers(0, 64, 9)
    got = cuda.rope(cupy.asarray(q), cupy.asarray(k), cupy.asarray(pos), cupy.asarray(table.astype(np.float32)))
    want = ref.rope(q.astype(np.float32), k.astype(np.float32), pos, table.astype(np.float32))
    for g, r in zip(got, want):
        assert rel_error(g.get(), r) < tol

    # rope_write_kv: host int64 positions and slots (CudaOps converts them), the caches filled at random.
    v = f16(rng.standard_normal((9, 2, 64)))
    slots = np.array([3, 40, -1, 7, 0, 12, -1, 63, 21])
    k_cache, v_cache = f16(rng.standard_normal((4, 16, 2, 64))), f16(rng.standard_normal((4, 16, 2, 64)))
    k_gpu, v_gpu = cupy.asarray(k_cache), cupy.asarray(v_cache)
    got = cuda.rope_write_kv(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), pos,
                             cupy.asarray(table.astype(np.float32)), k_gpu, v_gpu, slots)
    k_ref, v_ref = k_cache.astype(np.float32), v_cache.astype(np.float32)
    want = ref.rope_write_kv(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), pos,
                             table.astype(np.float32), k_ref, v_ref, slots)
    assert rel_error(got.get(), want) < tol
    assert rel_error(k_gpu.get(), k_ref) < tol
    assert rel_error(v_gpu.get(), v_ref) == 0

    # write_kv + attention through AttentionMetadata: two sequences, one prefill chunk, one decode.
    kv = np.zeros((1, 2, 6, 16, 2, 64), dtype)
    tables, ctx, qlens = [[4, 1], [5]], [20, 3], [20, 1]
    slots = [4 * 16 + p if p < 16 else 16 + p - 16 for p in range(20)] + [5 * 16 + 2]
    kv[0, :, 5, :2] = rng.standard_normal((2, 2, 2, 64))  # the decode sequence's cached prefix
    k_new, v_new = f16(rng.standard_normal((21, 2, 64))), f16(rng.standard_normal((21, 2, 64)))
    q = f16(rng.standard_normal((21, 4, 64)))
    kv_gpu = cupy.asarray(kv)
    meta_gpu = build_metadata(cupy, tables, ctx, qlens, slots)
    cuda.write_kv(cupy.asarray(k_new), cupy.asarray(v_new), kv_gpu[0, 0], kv_gpu[0, 1], meta_gpu.slot_mapping)
    kv_ref = kv.astype(np.float32)
    meta = build_metadata(np, tables, ctx, qlens, slots)
    ref.write_kv(k_new.astype(np.float32), v_new.astype(np.float32), kv_ref[0, 0], kv_ref[0, 1], meta.slot_mapping)
    assert rel_error(kv_gpu.get(), kv_ref) == 0
    got = cuda.attention(cupy.asarray(q), kv_gpu[0, 0], kv_gpu[0, 1], meta_gpu, 0.125).get()
    assert rel_error(got, ref.attention(q.astype(np.float32), kv_ref[0, 0], kv_ref[0, 1], meta, 0.125)) < tol
    # The same batch with a sliding window of 6 (the prefill's queries see 1..6 keys; the decode all 3).
    got = cuda.attention(cupy.asarray(q), kv_gpu[0, 0], kv_gpu[0, 1], meta_gpu, 0.125, sliding_window=6).get()
    windowed = windowed_attention_reference(q, kv_gpu[0, 0].get(), kv_gpu[0, 1].get(), np.array([[4, 1], [5, 0]]),
                                            np.array(ctx), np.array([0, 20, 21]), 0.125, 6)
    assert rel_error(got, windowed) < tol
    assert rel_error(got, ref.attention(q.astype(np.float32), kv_ref[0, 0], kv_ref[0, 1], meta, 0.125)) > 0.1
    unwindowed = cuda.attention(cupy.asarray(q), kv_gpu[0, 0], kv_gpu[0, 1], meta_gpu, 0.125, sliding_window=None)
    assert rel_error(unwindowed.get(), ref.attention(q.astype(np.float32), kv_ref[0, 0], kv_ref[0, 1], meta, 0.125)) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
def test_attention_runs_leading_decodes_apart_from_the_prefills(dtype, window):
    """A mixed step (5 decodes first, then a 40-token prompt chunk on a cached prefix and a 70-token prompt:
    160+ rows per KV head, the prefill kernel's size) gives the reference's result with the decodes split
    off (num_leading_decodes) and in one launch; shuffled block tables, random K/V in every slot."""
    from dataclasses import replace

    rng = np.random.default_rng(7)
    cuda, ref = CudaOps(), NumpyOps()
    block, hkv, group, d = 16, 2, 4, 64
    contexts, qlens = [33, 100, 7, 250, 64, 90, 70], [1, 1, 1, 1, 1, 40, 70]
    num_blocks = sum(-(-c // block) for c in contexts)
    perm = rng.permutation(num_blocks)
    tables, at = [], 0
    for c in contexts:
        n = -(-c // block)
        tables.append([int(b) for b in perm[at:at + n]])
        at += n
    cache = rng.standard_normal((2, num_blocks, block, hkv, d)).astype(np.float32)
    q = rng.standard_normal((sum(qlens), hkv * group, d)).astype(np.float32)
    meta = build_metadata(np, tables, contexts, qlens, [-1] * sum(qlens))
    want = ref.attention(q, cache[0], cache[1], meta, 0.125, sliding_window=window)
    kv = cupy.asarray(cache.astype(dtype))
    q_gpu = cupy.asarray(q.astype(dtype))
    meta_gpu = build_metadata(cupy, tables, contexts, qlens, [-1] * sum(qlens))
    split = cuda.attention(q_gpu, kv[0], kv[1], replace(meta_gpu, num_leading_decodes=5), 0.125,
                           sliding_window=window).get()
    whole = cuda.attention(q_gpu, kv[0], kv[1], meta_gpu, 0.125, sliding_window=window).get()
    assert rel_error(split, want) < OP_TOL[dtype]
    assert rel_error(whole, want) < OP_TOL[dtype]
    # any split point within the leading decodes gives the same result (here one decode stays with the prompts)
    assert rel_error(cuda.attention(q_gpu, kv[0], kv[1], replace(meta_gpu, num_leading_decodes=4), 0.125,
                                    sliding_window=window).get(), want) < OP_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_with_host_ids_and_with_a_chain(dtype):
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, 2, 8, 16, 1, 64)).astype(dtype)
    for src, dst in (([0, 3], [5, 6]), ([1, 2], [2, 7])):  # the second reads block 2 before overwriting it
        expected = kv.copy()
        NumpyOps().copy_blocks(expected, np.array(src), np.array(dst))
        kv_gpu = cupy.asarray(kv)
        CudaOps().copy_blocks(kv_gpu, src, dst)
        np.testing.assert_array_equal(kv_gpu.get().view(np.uint16), expected.view(np.uint16))


# Per dtype: (top-2 margin / max|logit| that counts as decisive, least share of decisive positions,
# largest max |logit err| / max |logit|). bf16 keeps 8 significant bits to fp16's 11, so its noise
# (and the margin below which a position is a coin toss) is about 8x larger.
FORWARD_BOUNDS = {np.dtype(np.float16): (3e-3, 0.85, 2e-2), BF16: (2.5e-2, 0.3, 8e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SMOLLM2_SHAPE, GQA4_D128_SHAPE, QWEN2_SHAPE, QWEN3_SHAPE],
                         ids=["smollm2-d64-gqa3", "d128-gqa4", "qwen2-bias", "qwen3-qk-norm"])
def test_llama_gpu_matches_cpu_fp32_teacher_forced(shape, dtype):
    config = LlamaConfig(**shape)
    weights = random_weights(config, seed=7)
    prompts = [np.random.default_rng(i).integers(0, config.vocab_size, n).tolist()
               for i, n in enumerate([37, 64, 12, 100, 150])]
    plan = [[(i, p[:len(p) // 2]) for i, p in enumerate(prompts)],  # first prefill chunks
            [(i, p[len(p) // 2:-3]) for i, p in enumerate(prompts)]]  # chunks on top of a cached prefix
    plan += [[(i, [p[-back]]) for i, p in enumerate(prompts)] for back in (3, 2, 1)]  # decode steps

    def run(ops, dtype):
        runner = SimpleRunner(Llama(config, weights, ops, dtype), num_blocks=64, block_size=16, seed=11)
        return np.concatenate([np.concatenate(runner.step(batch, all_logits=True)) for batch in plan])

    cpu = run(NumpyOps(), np.float32)  # [rows, V]
    gpu = run(CudaOps(), dtype)
    agreement = float(np.mean(cpu.argmax(-1) == gpu.argmax(-1)))
    error = rel_error(gpu, cpu)
    # fp16 logits carry ~1e-3 relative error, so a position whose top-2 margin is below that is a coin toss
    # for any correct fp16 implementation; a broken kernel disagrees on decisive positions too.
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    margin, least_decisive, max_error = FORWARD_BOUNDS[dtype]
    decisive = (top2[:, 1] - top2[:, 0]) > margin * np.abs(cpu).max()
    decisive_agreement = float(np.mean((cpu.argmax(-1) == gpu.argmax(-1))[decisive]))
    print(f"\n{dtype.name} {config.num_hidden_layers} layers, D={config.head_dim}, GQA {config.num_attention_heads // config.num_key_value_heads}: "
          f"{len(cpu)} positions, next-token agreement {agreement:.4f} (on {decisive.sum()} decisive positions "
          f"{decisive_agreement:.4f}), max |logit err| / max |logit| {error:.2e}, mean |err| {np.abs(gpu - cpu).mean():.2e}")
    assert np.isfinite(gpu).all()
    assert decisive.mean() > least_decisive
    assert decisive_agreement >= 0.99
    assert agreement >= (0.98 if dtype == np.float16 else 0.9)
    assert error < max_error
