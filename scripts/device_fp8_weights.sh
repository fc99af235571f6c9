#!/usr/bin/env bash
# FP8 weights on CUDA check on the lent device machine (issue 25, item 2), in one call:
#   1. the FP8-weight GPU tests (quantize kernel bytes, the cuBLASLt FP8 product against NumPy's Fp8Linear at the
#      1B / 8B layer shapes, graph replay; the engine teacher-forced against the CPU FP8 engine, graphs vs eager),
#      then the 16-bit GEMM / graph tests the change touched (TunedGemm gained the FP8 entry point);
#   2. `offline-paged bench --json` with --quantization none --quantization fp8 and --kv-cache-dtype auto
#      --kv-cache-dtype fp8 (four runs in one process, so every ratio is measured in one call) at the 1B and 8B
#      shapes in bfloat16, CUDA graphs on. Records go to $OUT/bench_*.json (then one archive);
#   3. a short table: out tok/s, ratio to the w=none kv=auto run, % of the roofline floor (bytes as stored).
# If the tests fail, models/llama.py's FP8_WEIGHTS_ON_CUDA = False switches FP8 weights on CUDA off again.
# `epilogue` instead: the FP8-linear kernel tests (both forms of the quantize and scale kernels, the fused rms_norm /
# silu_mul quantize, the FP8 engine), their kernel bench (benchmarks/bench_fp8_epilogue.py) and the 8B bench (bf16,
# FP8 weights + FP8 KV) for each of VARIANTS (fp8_launcher.VECTOR_KERNELS x cuda_fp8_linear.FUSED_FP8_INPUTS, set
# by device-side edits, undone after), REPEATS times interleaved.
# `rule`: tests/test_gpu_engine_fp8_weights.py with the FP8 input kernels' thread rule on
# (launchers.FP8_INPUT_CHUNKS_PER_THREAD = None), then the 8B bench in bf16 once and with FP8 weights + KV for the
# rule off (1) and on (None), REPEATS (default 2) times interleaved.
#
# Usage: OUT=/tmp/out [RUNS="1b 8b"] [REPEATS=1] [VARIANTS="off:False:False both:True:True"]
#        scripts/device_fp8_weights.sh [tests|bench|all|epilogue|fused|rule]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fp8w-out}
WHAT=${1:-all}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the device image lacks, carried as .whl/ (git-ignored)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

archive_records() {  # at most 8 files come back from the device: the records travel as one archive
  tar czf "$OUT/bench_records.tgz" -C "$OUT" $(cd "$OUT" && ls bench_*.json bench_*.err) && rm -f "$OUT"/bench_*.json "$OUT"/bench_*.err
}

report_runs() {  # one line per run of each bench_*.json record (oldest record first), then archive_records
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json"), key=lambda p: p.stat().st_mtime):
    try:
        runs = json.loads(path.read_text().strip().splitlines()[-1])["runs"]
    except (ValueError, IndexError, KeyError):
        print(f"{path.stem}: no record"); continue
    for run in runs:
        print(f"{path.stem:<20}{run['label']:<28}{run['output_tokens_per_s']:>10,.0f} out tok/s, forward "
              f"{run['time_split']['forward_device_ms']:.2f} ms, "
              f"{(run.get('roofline') or {}).get('fraction_of_floor', 0):.1%} of floor")
PY
  archive_records
}

if [ "$WHAT" = fused ]; then  # the fused FP8 inputs / deferred epilogues: tests, kernel bench, 8B on vs off
  timeout ${FP8_TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_cuda_fp8_fused.py \
    tests/test_ops_cuda_fp8_linear.py tests/test_gpu_engine_fp8_weights.py tests/test_ops_cuda.py \
    >"$OUT/fp8w_tests.log" 2>&1
  echo "fp8 fused gpu tests: $(tail -1 "$OUT/fp8w_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/fp8w_tests.log" | head -20
  timeout 90 env PYTHONPATH="benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_fp8_inputs.py 2>&1 \
    || echo "bench_fp8_inputs FAILED"
  FUSED="offline_paged/ops/cuda_fp8_linear.py"
  cp $FUSED /tmp/fused.orig  # (the device's git HEAD is not this tree)
  PYTHONFAULTHANDLER=1 timeout 220 offline-paged bench --device cuda --json --cuda-graphs --dtype bfloat16 \
    --quantization none --quantization fp8 --kv-cache-dtype auto --kv-cache-dtype fp8 \
    --dummy-weights llama-3.1-8b >"$OUT/bench_8b_fused.json" 2>"$OUT/bench_8b_fused.err" || echo "bench FAILED"
  sed -i "s/^FUSED_FP8_INPUTS = .*/FUSED_FP8_INPUTS = False/" $FUSED
  PYTHONFAULTHANDLER=1 timeout 100 offline-paged bench --device cuda --json --cuda-graphs --dtype bfloat16 \
    --quantization fp8 --kv-cache-dtype fp8 --dummy-weights llama-3.1-8b \
    >"$OUT/bench_8b_unfused.json" 2>"$OUT/bench_8b_unfused.err" || echo "bench unfused FAILED"
  cp /tmp/fused.orig $FUSED
  report_runs
  exit 0
fi

if [ "$WHAT" = rule ]; then  # the FP8 input kernels' thread rule (launchers.FP8_INPUT_CHUNKS_PER_THREAD None) vs 1
  RULE="offline_paged/ops/launchers.py"
  grep -q "^FP8_INPUT_CHUNKS_PER_THREAD: int | None = " $RULE || { echo "the switch line moved"; exit 1; }
  cp $RULE /tmp/rule.orig  # (the device's git HEAD is not this tree)
  set_rule() { cp /tmp/rule.orig $RULE; sed -i "s/^FP8_INPUT_CHUNKS_PER_THREAD: int | None = .*/FP8_INPUT_CHUNKS_PER_THREAD: int | None = $1/" $RULE; }
  set_rule None
  timeout ${FP8_TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine_fp8_weights.py \
    >"$OUT/fp8w_tests.log" 2>&1
  echo "fp8 weights engine tests, rule on: $(tail -1 "$OUT/fp8w_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/fp8w_tests.log" | head -20
  cp /tmp/rule.orig $RULE
  PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-200} offline-paged bench --device cuda --json --cuda-graphs \
    --dtype bfloat16 --dummy-weights llama-3.1-8b >"$OUT/bench_bf16.json" 2>"$OUT/bench_bf16.err" || echo "bench bf16 FAILED"
  for i in $(seq ${REPEATS:-2}); do
    for variant in off:1 on:None; do
      IFS=: read -r name value <<<"$variant"
      set_rule $value
      PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-200} offline-paged bench --device cuda --json --cuda-graphs \
        --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 --dummy-weights llama-3.1-8b \
        >"$OUT/bench_rule_${name}_$i.json" 2>"$OUT/bench_rule_${name}_$i.err" \
        || { echo "bench $name FAILED"; tail -5 "$OUT/bench_rule_${name}_$i.err"; }
    done
  done
  cp /tmp/rule.orig $RULE
  report_runs
  exit 0
fi

if [ "$WHAT" = epilogue ]; then
  timeout ${FP8_TEST_LIMIT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_cuda_fp8_linear.py \
    tests/test_ops_cuda_fp8_fused.py tests/test_gpu_engine_fp8_weights.py >"$OUT/fp8w_tests.log" 2>&1
  echo "fp8 linear gpu tests: $(tail -1 "$OUT/fp8w_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/fp8w_tests.log" | head -20
  timeout 150 env PYTHONPATH="benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_fp8_epilogue.py 2>&1 \
    || echo "bench_fp8_epilogue FAILED"
  # Variants name:VECTOR_KERNELS:FUSED_FP8_INPUTS, set by device-side edits of the two switches (undone after).
  VECTOR="offline_paged/ops/fp8_launcher.py" FUSED="offline_paged/ops/cuda_fp8_linear.py"
  grep -q "^VECTOR_KERNELS = " $VECTOR && grep -q "^FUSED_FP8_INPUTS = " $FUSED \
    || { echo "a switch line moved"; exit 1; }
  cp $VECTOR /tmp/vector.orig; cp $FUSED /tmp/fused.orig  # (the device's git HEAD is not this tree)
  for i in $(seq ${REPEATS:-1}); do
    for variant in ${VARIANTS:-off:False:False vector:True:False fused:False:True both:True:True}; do
      IFS=: read -r name vector fused <<<"$variant"
      sed -i "s/^VECTOR_KERNELS = .*/VECTOR_KERNELS = $vector/" $VECTOR
      sed -i "s/^FUSED_FP8_INPUTS = .*/FUSED_FP8_INPUTS = $fused/" $FUSED
      PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-200} offline-paged bench --device cuda --json --cuda-graphs \
        --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 --dummy-weights llama-3.1-8b \
        >"$OUT/bench_${name}_$i.json" 2>"$OUT/bench_${name}_$i.err" \
        || { echo "bench $name FAILED"; tail -5 "$OUT/bench_${name}_$i.err"; }
      cp /tmp/vector.orig $VECTOR; cp /tmp/fused.orig $FUSED
    done
  done
  report_runs
  exit 0
fi

if [ "$WHAT" != bench ]; then
  timeout ${FP8_TEST_LIMIT:-400} python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/test_ops_cuda_fp8_linear.py tests/test_gpu_engine_fp8_weights.py >"$OUT/fp8w_tests.log" 2>&1
  echo "fp8 weight gpu tests: $(tail -1 "$OUT/fp8w_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/fp8w_tests.log" | head -20
  grep -E "fp8 weights, kv|tokens equal before" "$OUT/fp8w_tests.log" | head -16
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py \
    tests/test_cuda_graph_runner.py tests/test_gpu_engine.py >"$OUT/gpu_tests_16bit.log" 2>&1
  echo "16-bit gpu tests: $(tail -1 "$OUT/gpu_tests_16bit.log")"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests_16bit.log" | head -20
fi
[ "$WHAT" = tests ] && exit 0

run() {  # name, then bench flags
  local name=$1; shift
  PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-560} offline-paged bench --device cuda --json --cuda-graphs \
    --dtype bfloat16 --quantization none --quantization fp8 --kv-cache-dtype auto --kv-cache-dtype fp8 "$@" \
    >"$OUT/bench_$name.json" 2>"$OUT/bench_$name.err" || { echo "bench $name FAILED"; tail -5 "$OUT/bench_$name.err"; }
}
RUNS=${RUNS:-"1b 8b"}
for name in $RUNS; do
  case $name in
    1b) run fp8w_$name --dummy-weights llama-3.2-1b ;;
    8b) run fp8w_$name --dummy-weights llama-3.1-8b ;;
  esac
done

python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<34}{'out tok/s':>11}{'vs bf16':>9}{'% floor':>9}{'floor tok/s':>12}{'KV blocks':>10}")
record = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    try:
        record = json.loads(path.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{path.stem[6:]:<34} (no record)"); continue
    base = next((r["output_tokens_per_s"] for r in record["runs"]
                 if r["quantization"] is None and r["kv_cache_dtype"] == "auto"), None)
    for r in record["runs"]:
        roof = r["roofline"] or {}
        ratio = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{path.stem[6:] + ' ' + r['label']:<34}{r['output_tokens_per_s']:>11,.0f}{ratio:>9}"
              f"{roof.get('fraction_of_floor', 0):>9.1%}{roof.get('output_tokens_per_s_at_floor', 0):>12,.0f}"
              f"{r['num_gpu_blocks']:>10}")
print("commit", record.get("git_commit"), "device", record.get("device"))
PY
archive_records
