#!/usr/bin/env bash
# Session 59's device calls (~9.5 min each on an H100 or H200; carry .whl):
#   COMMIT=<hash> OUT=$OUT [PART=1|2|3|4|5|6] [BUDGET=seconds] [SEARCH_S=seconds] scripts/device_s59.sh
# PART=1 (branch s59-row-split, f6b5862): rms_norm_fp8 / silu_mul_fp8's rows split over clusters: their tests,
# planted bugs (no peer's amax; every CTA's warp sums read from rank 0) that must fail them, their kernel bench at
# 256-16 rows; the 8B FP8 w + KV bench with the split and without (two pairs) and the 8B bf16 bench (issue 25's ratio
# in this call); the engine GPU tests (the CLI generate on the GPU, graphs, bench with graphs on and off) and the FP8
# engine tests. (On main, without the split, PART=1 fails at its first step.)
# PART=2 (main): 64 cuBLASLt candidates against 16 and a bf16 run (issue 25's ratio), the kernel test files, the FP8
# kernel files, the rest of the GPU files and the kernel profile with its launch gaps, until BUDGET runs out.
# PART=3 (main, ~6 min): benchmarks/bench_fp8_gemm_search.py (cuBLASLt's FP8 algorithms beyond the heuristic's 16 at
# the 8B decode GEMMs), then the engine with 64 candidates against 16 and a bf16 run.
# PARTs 5 and 6 apply benchmarks/pending/s61-fp8-buckets.patch first (session 61's work, not yet run on a device).
# PART=5 (session 61): the FP8 GEMM tests, the 8B FP8 w + KV bench without / with the eager products tuned per row
# bucket (ops_cuda.WARM_FP8_PRODUCTS; WARM_CANDIDATES=64 once) and tile neighbours (cublaslt.FP8_TILE_NEIGHBOUR_ROWS=256),
# bf16 (~9.5 min).
# PART=6 (session 61): the engine GPU tests (generate on the GPU, graphs, bench graphs on / off), the FP8 engine
# tests, the prefill search at 7,554 rows.
# PART=4 (session 60): the 1B bf16 and FP8 KV runs (two pairs) and the 8B bf16 run: issue 23's floor shares on an
# H200, issue 25's 1B ratio.
set -u
export PYTHONUNBUFFERED=1 OFFLINE_PAGED_GIT_COMMIT=${COMMIT:?}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; START=$(date +%s)
if [ "${PART:-1}" -ge 5 ]; then  # session 61's work, parked as a patch on main (it did not run on a device)
  git apply benchmarks/pending/s61-fp8-buckets.patch 2>/dev/null || patch -p1 -s < benchmarks/pending/s61-fp8-buckets.patch \
    || { echo "s61-fp8-buckets.patch does not apply"; exit 1; }
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || tail /tmp/pip.log
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - START) )); }
bench() {  # label knobs... -- args...
  local label=$1; shift; local knobs=(); while [ "$1" != "--" ]; do knobs+=("$1"); shift; done; shift
  [ $(left) -lt 60 ] && { echo "$label SKIPPED (time)"; return; }
  timeout 120 python3 scripts/knob_bench.py "${knobs[@]}" bench --device cuda --json "$@" \
    >/tmp/bench.json 2>/tmp/bench.err || { echo "$label FAILED"; tail -5 /tmp/bench.err; return; }
  python3 -c "import json, sys; d = json.loads(open('/tmp/bench.json').read().strip().splitlines()[-1]); \
d['call_label'] = sys.argv[1]; print(json.dumps(d))" "$label" >>"$OUT/records.jsonl"
  python3 -c "import json, sys; d = json.loads(open('/tmp/bench.json').read().strip().splitlines()[-1]); r = d['runs'][0]; \
k = r['step_kinds']; print(sys.argv[1], round(r['output_tokens_per_s']), 'tok/s', \
f\"{r['roofline']['fraction_of_floor']:.1%} of floor\" if r.get('roofline') else '', \
' '.join(f\"{n}: {v['num_steps']} x {v['forward_device_ms']:.2f} ms\" for n, v in k.items()), \
f\"start {r.get('engine_start_s', 0):.1f} s\")" "$label" 2>&1 | cut -c1-300
}
F8="--dummy-weights llama-3.1-8b --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8"
B16="--dummy-weights llama-3.1-8b --dtype bfloat16"
B1="--dummy-weights llama-3.2-1b --dtype bfloat16"
B1F8="--dummy-weights llama-3.2-1b --dtype bfloat16 --kv-cache-dtype fp8"
C64=offline_paged.ops.cublaslt.NUM_CANDIDATES=64
NOKNOB=offline_paged.ops.cublaslt.NUM_CANDIDATES=16
NOSPLIT="offline_paged.ops.launchers.FP8_SPLITS=(1,)"
run_tests() {  # name limit files...
  local name=$1 limit=$2; shift 2
  [ $(left) -lt 30 ] && { echo "$name SKIPPED (time)"; return; }
  [ $limit -gt $(left) ] && limit=$(left)
  timeout $limit python3 -m pytest -q -x --durations=3 "$@" >"$OUT/gpu_tests_$name.log" 2>&1
  local rc=$?; echo "$name rc=$rc $(tail -1 $OUT/gpu_tests_$name.log) [$(( $(date +%s) - START )) s]"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests_$name.log" | head -8
}
profile() {  # name bench args...
  local name=$1; shift
  [ $(left) -lt 120 ] && { echo "profile $name SKIPPED (time)"; return; }
  timeout 150 python3 benchmarks/profile_kernels.py --top 30 --gap-us 20 -- "$@" --no-roofline >"$OUT/profile_$name.txt" 2>&1
  echo "profile $name rc=$?"; sed -n '/kernel time over/,$p' "$OUT/profile_$name.txt" | cut -c1-130 | head -70
}
if [ "${PART:-1}" = 1 ]; then
run_tests split 150 tests/test_ops_cuda_fp8_fused.py -k "reads_a_product"
cp cuda/layer.cu /tmp/layer.cu.keep  # planted: a split row's amax from its own CTA only; every warp sum read from rank 0
python3 - <<'PY'
p = "cuda/layer.cu"; s = open(p).read()
for old, new in [("for (int rank = 0; rank < SPLIT; ++rank) value = nan_max", "for (int rank = 0; rank < 1; ++rank) value = nan_max"),
                 ("load_cluster_shared(&warp_sums[lane % warps], lane / warps)", "load_cluster_shared(&warp_sums[lane % warps], 0)")]:
    assert old in s, f"planted bug: {old!r} not found"
    s = s.replace(old, new)
open(p, "w").write(s)
PY
run_tests planted_silu 90 tests/test_ops_cuda_fp8_fused.py -k "silu_mul_fp8_reads_a_product and split-4 and acc-bf16"
run_tests planted_norm 90 tests/test_ops_cuda_fp8_fused.py -k "rms_norm_fp8_reads_a_product and split-4 and acc-bf16"
cp /tmp/layer.cu.keep cuda/layer.cu
PYTHONPATH=benchmarks:$PYTHONPATH timeout 90 python3 benchmarks/bench_fp8_inputs.py --product --rows 256 200 136 64 16 \
  2>&1 | tail -32
bench fp8_split $NOKNOB -- $F8; bench fp8_nosplit $NOSPLIT -- $F8; bench bf16 $NOKNOB -- $B16
bench fp8_split_b $NOKNOB -- $F8; bench fp8_nosplit_b $NOSPLIT -- $F8
run_tests quick 140 tests/test_gpu_engine.py tests/test_graphs.py tests/test_gpu_bench.py
run_tests fp8_engine 200 tests/test_gpu_engine_fp8_weights.py tests/test_gpu_engine_fp8.py
elif [ "${PART}" = 2 ]; then
bench fp8_c64 $C64 -- $F8; bench fp8_c16 $NOKNOB -- $F8; bench bf16 $NOKNOB -- $B16
run_tests kernels 200 tests/test_launchers.py tests/test_attention_quantize.py tests/test_ops_cuda.py \
  tests/test_prefill_attention.py tests/test_step_inputs_launcher.py tests/test_sampling_launcher.py
run_tests fp8 200 tests/test_ops_cuda_fp8_fused.py tests/test_ops_cuda_fp8.py tests/test_ops_cuda_fp8_linear.py
run_tests rest 300 tests/test_mixed_graphs.py tests/test_cuda_graph_runner.py tests/test_gpu_async.py tests/test_gc_pacing.py \
  tests/test_gpu_structured.py tests/test_gpu_sampler.py tests/test_graph_sampling.py tests/test_swap.py \
  tests/test_weight_upload.py tests/test_embeddings.py tests/test_loader.py
profile fp8 $F8
elif [ "${PART}" = 3 ]; then
PYTHONPATH=benchmarks:$PYTHONPATH timeout 60 python3 benchmarks/bench_fp8_gemm_search.py --rows 7554 2>&1 | tail -5
PYTHONPATH=benchmarks:$PYTHONPATH timeout ${SEARCH_S:-150} python3 benchmarks/bench_fp8_gemm_search.py --rows 144 2>&1 | tail -6
bench fp8_c64 $C64 -- $F8; bench fp8_c16 $NOKNOB -- $F8; bench bf16 $NOKNOB -- $B16
[ $(left) -gt 100 ] && PYTHONPATH=benchmarks:$PYTHONPATH timeout $(( $(left) - 20 )) \
  python3 benchmarks/bench_fp8_gemm_search.py --rows 256 64 2>&1 | tail -10
elif [ "${PART}" = 4 ]; then  # issue 23's floor shares and issue 25's 1B ratio (on an H200 for issue 23)
bench 1b_bf16 $NOKNOB -- $B1; bench 1b_fp8kv $NOKNOB -- $B1F8; bench 8b_bf16 $NOKNOB -- $B16
bench 1b_bf16_b $NOKNOB -- $B1; bench 1b_fp8kv_b $NOKNOB -- $B1F8
elif [ "${PART}" = 5 ]; then  # session 61: eager FP8 products tuned per row bucket (WARM), tile neighbours (NB)
run_tests fp8_linear 150 tests/test_ops_cuda_fp8_linear.py
cp offline_paged/ops/cublaslt.py /tmp/cublaslt.py.keep  # planted: the winner appended, not put first
sed -i 's/        plan.algos.insert(0, winner)/        plan.algos.append(winner)/' offline_paged/ops/cublaslt.py
run_tests planted_adopt 60 tests/test_ops_cuda_fp8_linear.py -k untuned_gemm_runs_the_winner
cp /tmp/cublaslt.py.keep offline_paged/ops/cublaslt.py
W0=offline_paged.ops.ops_cuda.WARM_FP8_PRODUCTS=False; W1=offline_paged.ops.ops_cuda.WARM_FP8_PRODUCTS=True
NB=offline_paged.ops.cublaslt.FP8_TILE_NEIGHBOUR_ROWS=256; NB0=offline_paged.ops.cublaslt.FP8_TILE_NEIGHBOUR_ROWS=0
WC64=offline_paged.ops.ops_cuda.WARM_CANDIDATES=64
bench fp8_base $W0 $NB0 -- $F8; bench fp8_warm $W1 $NB0 -- $F8; bench bf16 $W0 $NB0 -- $B16
bench fp8_nb $W0 $NB -- $F8; bench fp8_base_b $W0 $NB0 -- $F8; bench fp8_warm_b $W1 $NB0 -- $F8
bench fp8_warm64 $W1 $NB0 $WC64 -- $F8; bench fp8_both $W1 $NB -- $F8
elif [ "${PART}" = 6 ]; then  # session 61, the second call: the quick engine tests, the prefill search, FP8 engines
run_tests quick 140 tests/test_gpu_engine.py tests/test_graphs.py tests/test_gpu_bench.py
run_tests fp8_engine 200 tests/test_gpu_engine_fp8_weights.py tests/test_gpu_engine_fp8.py
[ $(left) -gt 80 ] && PYTHONPATH=benchmarks:$PYTHONPATH timeout 60 python3 benchmarks/bench_fp8_gemm_search.py \
  --rows 7554 2>&1 | tail -5
fi
echo "done [$(( $(date +%s) - START )) s]"
