"""Decode attention on a mixed-length batch, by key-split count (GPU): is the step's attention limited by
load balance? Prints GB/s of K/V read and the fraction of the device-to-device copy bandwidth measured in
the same run, for forced split counts and for the planner's choice.

The batch is the bench's steady state: 256 sequences of the Llama-3.2-1B attention shape (32 heads, 8 KV
heads, head dim 64, block size 16), context lengths uniform in 100..1900, block tables shuffled.
Times are medians of CUDA-graph replays (bench_kernels.graph_ms), so launch overhead is excluded.

    PYTHONPATH=benchmarks python3 benchmarks/bench_decode_splits.py [--head-dim 64] [--max-context 1900]
        [--variants default depth2 decode2 prefill3 registers] [--splits plan 1 2 4] [--prefill]
        [--order random|longest-first|shortest-first|launch-order] [--kv-cache-dtype fp8] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np
from bench_kernels import copy_bandwidth_gbs, graph_ms, random_f16

from offline_paged.ops import launchers, kernel_modules as modules, step_inputs_launcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--min-context", type=int, default=100)
    parser.add_argument("--max-context", type=int, default=1900)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    parser.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", *launchers.ATTENTION_KERNELS],
                        help="attention kernels to time (auto: the launcher's choice)")
    parser.add_argument("--splits", nargs="+", type=lambda v: None if v == "plan" else int(v),
                        default=[None, 1, 2, 4])
    parser.add_argument("--order", choices=("random", "longest-first", "shortest-first", "launch-order"),
                        default="random",
                        help="the batch's sequence order by context length (the hardware hands CTAs out in "
                             "launch order, so longest-first is the classic remedy for a ragged last wave); "
                             "launch-order: random, launched longest first through the kernel's launch_order "
                             "(what the decode graphs do)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                        help="the activations' (and a 16-bit cache's) element type")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="fp8: the caches hold e4m3 bytes (random normal values, scales 1.0); GB/s then "
                             "counts one byte per element")
    parser.add_argument("--prefill", action="store_true",
                        help="every sequence's whole context is its query (a prefill step: the row-split kernel); "
                             "prints TFLOP/s of the causal products")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    block, d, hkv, h = 16, args.head_dim, args.num_kv_heads, args.num_heads
    lens = rng.integers(args.min_context, args.max_context + 1, args.batch)  # [S]
    if args.order in ("longest-first", "shortest-first"):
        lens = np.sort(lens)[::-1].copy() if args.order == "longest-first" else np.sort(lens)
    tables, num_blocks = shuffled_tables(rng, lens, block, args.max_context)  # [S, M]
    fp8 = args.kv_cache_dtype == "fp8"
    dtype = np.dtype(np.float16) if args.dtype == "float16" else launchers.BFLOAT16

    def random_16(n: int):
        return random_f16(n).astype(dtype, copy=False)

    new_cache = random_e4m3 if fp8 else random_16
    k_cache = new_cache(num_blocks * block * hkv * d).reshape(num_blocks, block, hkv, d)
    v_cache = new_cache(num_blocks * block * hkv * d).reshape(num_blocks, block, hkv, d)
    kv_scale = cupy.ones(2, dtype=cupy.float32) if fp8 else None  # [2]: (k_scale, v_scale)
    q_lens = lens if args.prefill else np.ones_like(lens)  # [S]
    q = random_16(int(q_lens.sum()) * h * d).reshape(-1, h, d)
    tables_d, lens_d = cupy.asarray(tables), cupy.asarray(lens.astype(np.int32))
    qsl = cupy.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))  # [S + 1]
    order = None
    if args.order == "launch-order":
        order = cupy.empty(args.batch, dtype=cupy.int32)  # [S]
        step_inputs_launcher.launch_order(lens_d, order)
    kv_bytes = int(lens.sum()) * hkv * d * 2 * k_cache.itemsize  # K and V read once
    flops = 4 * h * d * int((lens * (lens + 1) // 2).sum())  # QK^T and PV over the causal triangle
    copy = copy_bandwidth_gbs()
    print(f"batch {args.batch}, contexts {args.min_context}..{args.max_context} (mean {lens.mean():.0f}), "
          f"{'prefill' if args.prefill else 'decode'}, head dim {d}, {h}/{hkv} heads, {args.dtype}, "
          f"{args.kv_cache_dtype} cache; "
          f"K/V {kv_bytes / 1e9:.2f} GB; "
          f"copy {copy:,.0f} GB/s")
    rate = "TFLOP/s" if args.prefill else "GB/s"
    print(f"{'variant':>14}{'kernel':>10}{'splits':>8}{'ms':>9}{rate:>9}{'of copy':>9}{'max|diff|':>11}")
    original = modules.read_source
    stages = {name: getattr(launchers, name) for name in _STAGE_CONSTANTS}
    reference = None
    for variant in args.variants:
        modules.read_source = lambda name, v=variant: modules.replaced(original(name), VARIANTS[v][0], v)
        for name in _STAGE_CONSTANTS:  # a variant's tuple may stop early: the rest keep the tree's values
            setattr(launchers, name, stages[name])
        for name, value in zip(_STAGE_CONSTANTS, VARIANTS[variant][1]):
            setattr(launchers, name, value)
        modules.clear_cache()
        launchers.clear_plans()
        for kernel, splits in [(k, n) for k in args.kernels for n in args.splits]:
            def run(splits=splits, kernel=None if kernel == "auto" else kernel):
                return launchers.paged_attention(q, k_cache, v_cache, tables_d, lens_d, qsl, int(q_lens.max()),
                                                 args.max_context, d ** -0.5, num_splits=splits,
                                                 launch_order=order, kv_scale=kv_scale, kernel=kernel)
            out = run()
            reference = out if reference is None else reference
            diff = float(cupy.abs(out.astype(cupy.float32) - reference.astype(cupy.float32)).max())
            ms = graph_ms(run, repeats=20)
            gbs = kv_bytes / ms / 1e6
            figure = f"{flops / ms / 1e9:>9,.0f}{'':>9}" if args.prefill else f"{gbs:>9,.0f}{gbs / copy:>9.1%}"
            print(f"{variant:>14}{kernel:>10}{'plan' if splits is None else splits:>8}{ms:>9.3f}{figure}{diff:>11.2e}")
    modules.read_source = original
    for name, value in stages.items():
        setattr(launchers, name, value)
    modules.clear_cache()
    launchers.clear_plans()


# Source variants of cuda/attention.cu, compared in one process (the first is the reference output): a
# variant is its source patches plus the (decode, decode over FP8, prefill) ring depths it gives launchers,
# which size the dynamic shared memory (the fp8 variants matter with --kv-cache-dtype fp8 only). The register
# variants keep the rings' launch size, unused (occupancy as before).
# Measured 2026-11-30 on the H200 (batch 256, contexts 100..1900, plan), register pipeline: depth1
# 0.198 ms (64.8% of copy), depth2 0.172 ms (74.7%, identical output), depth1 + lb4 0.177 ms (72.4%).
# The cp.async rings came after; see benchmarks/NOTES.md for their figures.
_DECODE = "constexpr int DECODE_RING_STAGES = 3;"
_PREFILL = "constexpr int PREFILL_RING_STAGES = 2;"
_DECODE_FP8 = "constexpr int DECODE_RING_STAGES_FP8 = 3;"
_DEPTH1 = ("constexpr int D64_PIPELINE_DEPTH = 2;", "constexpr int D64_PIPELINE_DEPTH = 1;")
_FP8_CAP = "#define FP8_D128_MIN_CTAS 3"
_LAUNCH_16 = "DEFINE_ATTENTION(128, keysplit, false, WideTile, T, SUFFIX, 1, FP8_D128_MIN_CTAS)"
_DECODE_CAP = "#define DECODE_D128_MIN_CTAS 3"
_DECODE_FP8_CAP = "#define DECODE_FP8_D128_MIN_CTAS 4"
_BIT_DEQUANT = ("#if __CUDA_ARCH__ >= 890", "#if 0")  # e4m3 -> fp16 by the bit path on every arch
_PV_IN_T = ("struct PvElement<T, fp8_e4m3_t> {\n  using type = __half;",
            "struct PvElement<T, fp8_e4m3_t> {\n  using type = T;")
_STAGE_CONSTANTS = ("DECODE_RING_STAGES", "DECODE_RING_STAGES_FP8", "PREFILL_RING_STAGES",
                    "DECODE_RING_STAGES_DENSE", "FP8_WIDE_DECODE", "FP8_DECODE_D128_RING")
_D128_REGISTERS = ("constexpr int FP8_DECODE_D128_RING = 1;", "constexpr int FP8_DECODE_D128_RING = 0;")
_WIDE_OFF = ("constexpr int FP8_WIDE_DECODE = 1;", "constexpr int FP8_WIDE_DECODE = 0;")
_QK_IN_T = ("#define FP8_QK_IN_HALF 1", "#define FP8_QK_IN_HALF 0")
_DENSE = "constexpr int DECODE_RING_STAGES_DENSE = 3;"
_DECODE_FP8_D64_CAP = "#define DECODE_FP8_D64_MIN_CTAS 4"
_DECODE_D64_CAP = "#define DECODE_D64_MIN_CTAS 4"
VARIANTS = {
    "default": ([], (3, 3, 2)),
    "decode2": ([(_DECODE, _DECODE.replace("3", "2"))], (2, 3, 2)),
    "decode4": ([(_DECODE, _DECODE.replace("3", "4"))], (4, 3, 2)),
    "prefill3": ([(_PREFILL, _PREFILL.replace("2", "3"))], (3, 3, 3)),
    "l2_128": ([("cp.async.cg.shared.global [", "cp.async.cg.shared.global.L2::128B [")], (3, 3, 2)),
    "depth2": ([(_DECODE, _DECODE.replace("3", "0"))], (3, 3, 2)),
    "depth1": ([(_DECODE, _DECODE.replace("3", "0")), _DEPTH1], (3, 3, 2)),
    "registers": ([(_DECODE, _DECODE.replace("3", "0")), (_PREFILL, _PREFILL.replace("2", "0"))], (0, 3, 0)),
    # 16-bit D = 128 capped at 168 registers for 3 CTAs per SM: it spills 320 bytes (0.43 against 0.31 ms).
    "lb3": ([(_LAUNCH_16, _LAUNCH_16.replace("SUFFIX, 1,", "SUFFIX, 3,"))], (3, 3, 2)),
    # The "decode" kernels (8-row tiles) at D = 128 without their register caps: 182 registers (2 CTAs per SM)
    # instead of 168 (3) for 16 bits, 144-148 (3) instead of 124-126 (4) over FP8; and FP8 capped for 3 CTAs.
    "dec_uncapped": ([(_DECODE_CAP, _DECODE_CAP.replace("3", "1")),
                      (_DECODE_FP8_CAP, _DECODE_FP8_CAP.replace("4", "1"))],
                     (3, 3, 2)),
    "dec_fp8cap3": ([(_DECODE_FP8_CAP, _DECODE_FP8_CAP.replace("4", "3"))], (3, 3, 2)),
    # FP8 cache (with --kv-cache-dtype fp8; 2026-12-03, 256 x 100..1900, launch order): the D = 64 ring of 2,
    # 4, 5 slots 0.147, 0.159, 0.188 ms against 3 slots' 0.143 (registers: 0.137 in one call, 0.159 against 0.147
    # in the next); D = 128 without the 3-CTA register cap (232 registers, 2 CTAs per SM), 0.271 ms, and so with
    # two chunks of K and V ahead, 0.253-0.255, against 0.216-0.217.
    "fp8ring2": ([(_DECODE_FP8, _DECODE_FP8.replace("3", "2"))], (3, 2, 2)),
    "fp8registers": ([(_DECODE_FP8, _DECODE_FP8.replace("3", "0"))], (3, 0, 2)),
    "fp8uncapped": ([(_FP8_CAP, _FP8_CAP.replace("3", "1"))], (3, 3, 2)),
    # e4m3 -> fp16 by the bit path (24 instructions per 8 elements) instead of cvt.rn.f16x2.e4m3x2 (4), and P.V
    # in T rather than fp16 over an FP8 cache (a bf16 model then converts V to bf16 by the bit path too).
    "fp8bitdequant": ([_BIT_DEQUANT], (3, 3, 2)),
    "fp8pv_t": ([_PV_IN_T], (3, 3, 2)),
    "fp8before": ([_BIT_DEQUANT, _PV_IN_T, ("#define FP8_D64_MIN_CTAS 4", "#define FP8_D64_MIN_CTAS 1")], (3, 3, 2)),
    # FP8 decode tiles (--kv-cache-dtype fp8): 8-byte loads in the 16-bit layout (the ring's too) as before
    # 2026-12-04, with QK^T in T or in fp16; the dense ring of 16-byte copies with 4 or 6 slots.
    "fp8narrow8": ([_WIDE_OFF, _QK_IN_T], (3, 3, 2, 3, 0)),
    "fp8narrow8_qkhalf": ([_WIDE_OFF], (3, 3, 2, 3, 0)),
    "fp8qk_t": ([_QK_IN_T], (3, 3, 2, 3, 1)),
    "fp8d128regs": ([_D128_REGISTERS], (3, 3, 2, 3, 1, 0)),  # D = 128 wide loads into registers, no ring
    "fp8dense4": ([(_DENSE, _DENSE.replace("3", "4"))], (3, 3, 2, 4, 1)),
    "fp8dense6": ([(_DENSE, _DENSE.replace("3", "6"))], (3, 3, 2, 6, 1)),
    # Occupancy of the decode tiles (2026-12-04): the dense FP8 ring at D = 64 is 24 KiB a CTA, so registers alone
    # (102) held it to 4 CTAs per SM; capped for 5, 6, 7 CTAs (93, 80 registers without spills, 72 with 24 bytes).
    # At D = 128 the ring (48 KiB) allows 4: two slots (32 KiB) with 4 or 5 CTAs (96 registers, 164 bytes spilled).
    # The 16-bit D = 64 ring of two slots (32 KiB) with 5 or 6 CTAs (96 registers; 80 with 52 bytes spilled).
    "fp8ctas5": ([(_DECODE_FP8_D64_CAP, _DECODE_FP8_D64_CAP[:-1] + "5")], (3, 3, 2)),
    "fp8ctas6": ([(_DECODE_FP8_D64_CAP, _DECODE_FP8_D64_CAP[:-1] + "6")], (3, 3, 2)),
    "fp8ctas7": ([(_DECODE_FP8_D64_CAP, _DECODE_FP8_D64_CAP[:-1] + "7")], (3, 3, 2)),
    "fp8dense2": ([(_DENSE, _DENSE.replace("3", "2"))], (3, 3, 2, 2)),
    "fp8dense2_d128ctas5": ([(_DENSE, _DENSE.replace("3", "2")),
                            (_DECODE_FP8_CAP, _DECODE_FP8_CAP.replace("4", "5"))], (3, 3, 2, 2)),
    "ring2_ctas5": ([(_DECODE, _DECODE.replace("3", "2")), (_DECODE_D64_CAP, _DECODE_D64_CAP[:-1] + "5")],
                    (2, 3, 2)),
    "ring2_ctas6": ([(_DECODE, _DECODE.replace("3", "2")), (_DECODE_D64_CAP, _DECODE_D64_CAP[:-1] + "6")],
                    (2, 3, 2)),
    "fp8depth2": ([(_FP8_CAP, _FP8_CAP.replace("3", "1")),
                   ("constexpr bool PREFETCH_V = D == 64;", "constexpr bool PREFETCH_V = D == 64 || kIsFp8<C>;")],
                  (3, 3, 2)),
}


def shuffled_tables(rng, lens, block: int, max_context: int) -> tuple[np.ndarray, int]:
    """Block tables [S, ceil(max_context / block)] int32 for contexts `lens`, each sequence's blocks drawn from one
    shuffled pool of exactly the blocks they need; and that pool's size."""
    blocks_per_seq = -(-lens // block)
    num_blocks = int(blocks_per_seq.sum())
    tables = np.zeros((len(lens), -(-max_context // block)), np.int32)  # [S, M]
    perm = rng.permutation(num_blocks)
    at = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[at:at + n]
        at += n
    return tables, num_blocks


def random_e4m3(n: int):
    """n random e4m3fn bytes of magnitude below 2 (the exponent's top bit cleared, which also rules out NaN)."""
    return (cupy.random.randint(0, 256, n, dtype=cupy.int32) & 0xBF).astype(cupy.uint8)


if __name__ == "__main__":
    main()
