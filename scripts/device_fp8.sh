#!/usr/bin/env bash
# FP8 KV cache check on the lent device machine (issue 25), in one call:
#   1. the FP8 GPU tests first (kernels against the NumPy FP8 reference, the FP8 engine against the CPU FP8
#      engine and the 16-bit engine), then the 16-bit kernel and engine tests the change touched;
#   2. decode attention alone (bench_decode_splits.py, launch order as the graphs run it) over an FP8 and a
#      16-bit pool at head dims 64 (1B shape) and 128 (8B shape): GB/s of K/V as stored and % of copy, for the
#      FP8 variants in FP8_VARIANTS (the D = 64 ring against registers; D = 128 without the 3-CTA cap);
#   3. `offline-paged bench --json` with --kv-cache-dtype fp8 --kv-cache-dtype auto (both in one process, so
#      the ratio is measured in one call) at the 1B and 8B shapes in bfloat16, CUDA graphs on. Records go
#      to $OUT/bench_*.json (then one archive);
#   4. a short table: out tok/s, FP8 / auto, % of the roofline floor (KV bytes as stored), KV blocks.
#
# Usage: OUT=/tmp/out [RUNS="1b 8b 1b_n1024"] [SIXTEEN_BIT_TESTS=0] scripts/device_fp8.sh [tests|kernels|bench|all]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fp8-out}
WHAT=${1:-all}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the device image lacks, carried as .whl/ (git-ignored)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  timeout ${FP8_TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    tests/test_ops_cuda_fp8.py tests/test_gpu_engine_fp8.py >"$OUT/fp8_tests.log" 2>&1
  echo "fp8 gpu tests: $(tail -1 "$OUT/fp8_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/fp8_tests.log" | head -20
  grep -E "fp8 calculate=|calculate=(True|False):" "$OUT/fp8_tests.log" | head -12
  # The 16-bit paths the change touched (same kernels, new template parameter): must be unchanged.
  if [ "${SIXTEEN_BIT_TESTS:-1}" = 1 ]; then
    timeout ${TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_launchers.py \
      tests/test_prefill_attention.py tests/test_ops_cuda.py tests/test_cuda_graph_runner.py tests/test_gpu_engine.py \
      >"$OUT/gpu_tests_16bit.log" 2>&1
    echo "16-bit gpu tests: $(tail -1 "$OUT/gpu_tests_16bit.log")"
    grep -E "^FAILED|^ERROR" "$OUT/gpu_tests_16bit.log" | head -20
  fi
fi
[ "$WHAT" = tests ] && exit 0

if [ "$WHAT" = kernels ] || [ "$WHAT" = all ]; then
  FP8_VARIANTS=${FP8_VARIANTS:-"default fp8registers fp8uncapped fp8depth2"}
  for dim in 64 128; do
    for cache in auto fp8; do
      variants=default; [ $cache = fp8 ] && variants=$FP8_VARIANTS
      timeout ${KERNEL_LIMIT:-120} env PYTHONPATH="benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_decode_splits.py \
        --head-dim $dim --order launch-order --splits plan --kv-cache-dtype $cache --variants $variants 2>&1 \
        || echo "decode splits d=$dim $cache FAILED"
    done
  done
fi
[ "$WHAT" = kernels ] && exit 0

run() {  # name, then bench flags
  local name=$1; shift
  PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-400} offline-paged bench --device cuda --json --cuda-graphs \
    --dtype bfloat16 --kv-cache-dtype fp8 --kv-cache-dtype auto "$@" >"$OUT/bench_$name.json" 2>"$OUT/bench_$name.err" \
    || { echo "bench $name FAILED"; tail -5 "$OUT/bench_$name.err"; }
}
RUNS=${RUNS:-"1b 8b"}
for name in $RUNS; do
  case $name in
    1b) run fp8_$name --dummy-weights llama-3.2-1b ;;
    8b) run fp8_$name --dummy-weights llama-3.1-8b ;;
    1b_n1024) run fp8_$name --dummy-weights llama-3.2-1b --num-requests 1024 ;;
    1b_calculated) run fp8_$name --dummy-weights llama-3.2-1b --calculate-kv-scales ;;
  esac
done

python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<26}{'out tok/s':>11}{'fp8/auto':>9}{'% floor':>9}{'floor tok/s':>12}{'KV blocks':>10}{'max seqs':>9}")
record = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    try:
        record = json.loads(path.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{path.stem[6:]:<26} (no record)"); continue
    auto = {r["label"].replace("kv=auto", ""): r["output_tokens_per_s"] for r in record["runs"]
            if r["kv_cache_dtype"] == "auto"}
    for r in record["runs"]:
        roof = r["roofline"] or {}
        base = auto.get(r["label"].replace(f"kv={r['kv_cache_dtype']}", ""))
        ratio = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{path.stem[6:] + ' ' + r['kv_cache_dtype']:<26}{r['output_tokens_per_s']:>11,.0f}{ratio:>9}"
              f"{roof.get('fraction_of_floor', 0):>9.1%}{roof.get('output_tokens_per_s_at_floor', 0):>12,.0f}"
              f"{r['num_gpu_blocks']:>10}{r['max_concurrent_seqs']:>9}")
print("commit", record.get("git_commit"), "device", record.get("device"))
PY
# At most 8 files come back from the device: the records travel as one archive.
tar czf "$OUT/bench_records.tgz" -C "$OUT" $(cd "$OUT" && ls bench_*.json bench_*.err) && rm -f "$OUT"/bench_*.err "$OUT"/bench_*.json
