"""NumpyOps (ops/ops_numpy.py): KV writes, block copies, RMSNorm, RoPE, SwiGLU, logits, bias and the host swapper."""
from __future__ import annotations

import numpy as np

from offline_paged.ops.ops_numpy import HostSwapper, NumpyOps

HKV, D = 2, 8


def test_write_kv_skips_negative_slots():
    k_cache = np.zeros((2, 4, HKV, D), np.float32)  # [N, B, Hkv, D]
    v_cache = np.zeros((2, 4, HKV, D), np.float32)
    k = np.arange(3 * HKV * D, dtype=np.float32).reshape(3, HKV, D)  # [T, Hkv, D]
    NumpyOps().write_kv(k, -k, k_cache, v_cache, np.array([5, -1, 0], np.int32))
    np.testing.assert_array_equal(k_cache[1, 1], k[0])
    np.testing.assert_array_equal(k_cache[0, 0], k[2])
    np.testing.assert_array_equal(v_cache[0, 0], -k[2])
    assert np.count_nonzero(k_cache.reshape(8, -1).any(axis=1)) == 2


def test_copy_blocks_copies_every_layer_k_and_v():
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((3, 2, 5, 4, HKV, D)).astype(np.float32)  # [L, 2, N, B, Hkv, D]
    before = kv.copy()
    NumpyOps().copy_blocks(kv, np.array([0, 2]), np.array([4, 1]))
    np.testing.assert_array_equal(kv[:, :, 4], before[:, :, 0])
    np.testing.assert_array_equal(kv[:, :, 1], before[:, :, 2])
    np.testing.assert_array_equal(kv[:, :, [0, 2, 3]], before[:, :, [0, 2, 3]])


def test_rms_norm_residual_convention():
    rng = np.random.default_rng(4)
    x, res = rng.standard_normal((2, 3, 16)).astype(np.float32)  # [T, E] each
    w = rng.standard_normal(16).astype(np.float32)  # [E]
    normed, new_res = NumpyOps().rms_norm(x, w, 1e-6, res)
    s = x + res
    np.testing.assert_allclose(new_res, s, atol=0)
    np.testing.assert_allclose(normed, s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6) * w, atol=1e-6)
    normed0, res0 = NumpyOps().rms_norm(x, w, 1e-6)
    assert res0 is x


def test_rope_rotates_halves_by_position_angle():
    """Position p rotates pair (j, j + D/2) by angle p * f_j; position 0 is the identity."""
    ops = NumpyOps()
    freqs = np.array([1.0, 0.1, 0.01, 0.001])  # [D/2]
    angles = np.arange(10)[:, None] * freqs  # [P, D/2]
    cache = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)  # [P, D]
    q = np.zeros((2, 1, 8)); q[:, 0, 0] = 1.0  # unit vector on dimension 0 (pairs with dimension 4)
    k = np.zeros((2, 1, 8)); k[:, 0, 5] = 1.0  # unit vector on dimension 5 (pairs with dimension 1)
    rq, rk = ops.rope(q, k, np.array([0, 3]), cache)
    np.testing.assert_allclose(rq[0, 0], q[0, 0])
    np.testing.assert_allclose(rq[1, 0, [0, 4]], [np.cos(3.0), np.sin(3.0)], atol=1e-12)
    np.testing.assert_allclose(rk[1, 0, [1, 5]], [-np.sin(0.3), np.cos(0.3)], atol=1e-12)


def test_rope_write_kv_is_rope_then_write_kv():
    """The fused op returns rope's q and leaves the caches as write_kv of rope's k (and of v) would, with the
    views into one qkv row the model passes; rows of negative slots and untargeted rows keep their values."""
    rng = np.random.default_rng(8)
    num_tokens, num_heads, d = 6, 4, 8
    qkv = rng.standard_normal((num_tokens, (num_heads + 2 * HKV) * d)).astype(np.float32)  # [T, (H + 2Hkv) D]
    q = qkv[:, :num_heads * d].reshape(num_tokens, num_heads, d)  # [T, H, D]
    k = qkv[:, num_heads * d:(num_heads + HKV) * d].reshape(num_tokens, HKV, d)  # [T, Hkv, D]
    v = qkv[:, (num_heads + HKV) * d:].reshape(num_tokens, HKV, d)  # [T, Hkv, D]
    angles = np.arange(20)[:, None] * 0.3 ** np.arange(d // 2)  # [P, D/2]
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)  # [P, D]
    positions = np.array([3, 19, 7, 1, 12, 5])
    slots = np.array([9, -1, 2, 14, -1, 0], np.int32)
    k_cache, v_cache = rng.standard_normal((2, 4, 4, HKV, d)).astype(np.float32)  # [N, B, Hkv, D] each
    k_fill = k_cache.copy()
    k_want, v_want = k_cache.copy(), v_cache.copy()
    ops = NumpyOps()
    q_want, k_rotated = ops.rope(q, k, positions, table)
    ops.write_kv(k_rotated, v, k_want, v_want, slots)
    qkv_before = qkv.copy()

    q_got = ops.rope_write_kv(q, k, v, positions, table, k_cache, v_cache, slots)

    np.testing.assert_array_equal(q_got, q_want)
    np.testing.assert_array_equal(k_cache, k_want)
    np.testing.assert_array_equal(v_cache, v_want)
    np.testing.assert_array_equal(qkv, qkv_before)
    rows = k_cache.reshape(16, HKV, d)
    np.testing.assert_array_equal(rows[[2, 9, 14, 0]], k_rotated[[2, 0, 3, 5]])
    assert not np.allclose(rows[9], k[0], atol=1e-3)  # rotated (position 19), not copied as is
    np.testing.assert_array_equal(v_cache.reshape(16, HKV, d)[[2, 9, 14, 0]], v[[2, 0, 3, 5]])
    untouched = [r for r in range(16) if r not in (0, 2, 9, 14)]
    np.testing.assert_array_equal(rows[untouched], k_fill.reshape(16, HKV, d)[untouched])


def test_silu_mul_is_silu_of_the_first_half_times_the_second():
    rng = np.random.default_rng(5)
    gate_up = (rng.standard_normal((3, 2 * 6)) * 4).astype(np.float32)  # [T, 2I]
    gate, up = gate_up[:, :6], gate_up[:, 6:]
    want = gate * (1.0 / (1.0 + np.exp(-gate.astype(np.float64)))) * up  # silu(g) = g * sigmoid(g)
    np.testing.assert_allclose(NumpyOps().silu_mul(gate_up), want, rtol=1e-5, atol=1e-6)


def test_logits_are_float32_and_bias_adds_over_the_last_axis():
    rng = np.random.default_rng(6)
    hidden = rng.standard_normal((4, 8)).astype(np.float16)  # [K, E]
    lm_head = rng.standard_normal((8, 11)).astype(np.float16)  # [E, V]
    logits = NumpyOps().logits(hidden, lm_head)
    assert logits.dtype == np.float32 and logits.shape == (4, 11)
    np.testing.assert_allclose(logits, hidden.astype(np.float32) @ lm_head.astype(np.float32), rtol=2e-2, atol=2e-2)
    x = rng.standard_normal((3, 5)).astype(np.float32)  # [T, N]
    bias = rng.standard_normal(5).astype(np.float32)  # [N]
    np.testing.assert_array_equal(NumpyOps().add_bias(x, bias), x + bias[None, :])


def test_host_swapper_round_trips_whole_blocks_and_touches_nothing_else():
    rng = np.random.default_rng(7)
    kv = rng.standard_normal((2, 2, 6, 4, HKV, D)).astype(np.float32)  # [L, 2, N, B, Hkv, D]
    swapper = NumpyOps().make_swapper(kv, num_cpu_blocks=3)
    assert isinstance(swapper, HostSwapper) and swapper.cpu_cache.shape == (2, 2, 3, 4, HKV, D)
    before = kv.copy()
    swapper.swap_out([4, 1], [2, 0])
    np.testing.assert_array_equal(swapper.cpu_cache[:, :, 2], before[:, :, 4])
    np.testing.assert_array_equal(swapper.cpu_cache[:, :, 0], before[:, :, 1])
    kv[:] = rng.standard_normal(kv.shape)  # the device blocks get reused for other sequences
    overwritten = kv.copy()
    swapper.swap_in([2, 0], [3, 5])
    np.testing.assert_array_equal(kv[:, :, 3], before[:, :, 4])
    np.testing.assert_array_equal(kv[:, :, 5], before[:, :, 1])
    np.testing.assert_array_equal(kv[:, :, [0, 1, 2, 4]], overwritten[:, :, [0, 1, 2, 4]])
