#!/usr/bin/env bash
# Throughput v2 check on the lent device machine, in one call:
#   1. every GPU test (kernels, ops, sampler, graphs, the engine, the CLI job on the GPU, and
#      `offline-paged bench` end to end with CUDA graphs on and off);
#   2. `offline-paged bench --json` on the default workload: 1B shape graphs on, graphs off; 8B shape
#      graphs on; 1B shape at N=1024 (steady state). Records go to $OUT/bench_*.json;
#   3. a short table of the figures.
#
# Usage: OUT=/tmp/out [RUNS="1b_graphs 8b_graphs"] scripts/device_throughput.sh [tests|bench|all]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/throughput-out}
WHAT=${1:-all}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Wheels the device image lacks (llguidance for structured output), carried as .whl/ (git-ignored).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

if [ "$WHAT" != bench ]; then
  # Every gpu-marked test but the real model (scripts/device_real_model.sh) and the two-GPU ones
  # (scripts/device_tp.sh).
  # TESTS: files to run first (the ones a change touched), then the rest; TEST_IGNORE: more --ignore flags.
  timeout ${TEST_LIMIT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-} tests/ \
    --ignore=tests/test_gpu_real_model.py --ignore=tests/test_tensor_parallel_gpu.py ${TEST_IGNORE:-} \
    >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -30
fi
[ "$WHAT" = tests ] && exit 0

run() {  # name, then bench flags
  local name=$1; shift
  PYTHONFAULTHANDLER=1 timeout 200 offline-paged bench --device cuda --json "$@" >"$OUT/bench_$name.json" 2>"$OUT/bench_$name.err" \
    || { echo "bench $name FAILED"; tail -5 "$OUT/bench_$name.err"; }
}
RUNS=${RUNS:-"1b_graphs 1b_graphs_sync 1b_eager 8b_graphs 1b_graphs_n1024"}
for name in $RUNS; do
  case $name in
    1b_graphs|1b_graphs_again) run $name --dummy-weights llama-3.2-1b --cuda-graphs ;;
    1b_graphs_sync) run $name --dummy-weights llama-3.2-1b --cuda-graphs --sync-scheduling ;;
    1b_eager) run $name --dummy-weights llama-3.2-1b --no-cuda-graphs ;;
    8b_graphs) run $name --dummy-weights llama-3.1-8b --cuda-graphs ;;
    1b_graphs_n1024) run $name --dummy-weights llama-3.2-1b --cuda-graphs --num-requests 1024 ;;
    1b_graphs_n1024_a1) run $name --dummy-weights llama-3.2-1b --cuda-graphs --num-requests 1024 --admission-batch 1 ;;
    1b_structured|1b_structured_again) run $name --dummy-weights llama-3.2-1b --cuda-graphs --input-len 64:128 --output-len 128:192 --structured json ;;
    1b_json_x2) run $name --dummy-weights llama-3.2-1b --cuda-graphs --structured json --repeat 2 ;;
    1b_bf16_kv_x2) run $name --dummy-weights llama-3.2-1b --cuda-graphs --dtype bfloat16 --kv-cache-dtype auto --kv-cache-dtype fp8 --repeat 2 ;;
    1b_json_x3) run $name --dummy-weights llama-3.2-1b --cuda-graphs --structured json --repeat 3 ;;
    1b_json_m12) run $name --dummy-weights llama-3.2-1b --cuda-graphs --structured json --grammar-mask-processes 12 ;;
    1b_structured_x3) run $name --dummy-weights llama-3.2-1b --cuda-graphs --input-len 64:128 --output-len 128:192 --structured json --repeat 3 ;;
    1b_graphs_n4096) run $name --dummy-weights llama-3.2-1b --cuda-graphs --num-requests 4096 ;;
    1b_sharegpt_n4096) run $name --dummy-weights llama-3.2-1b --cuda-graphs --num-requests 4096 --dataset sharegpt-like ;;
    qwen3_0.6b) run $name --dummy-weights qwen3-0.6b --cuda-graphs ;;
    qwen2.5_7b) run $name --dummy-weights qwen2.5-7b --cuda-graphs ;;
    1b_bf16_fp16) run $name --dummy-weights llama-3.2-1b --cuda-graphs --dtype bfloat16 --dtype float16 ;;
    8b_bf16) run $name --dummy-weights llama-3.1-8b --cuda-graphs --dtype bfloat16 ;;
    mistral_7b) run $name --dummy-weights mistral-7b --cuda-graphs --dtype bfloat16 ;;
  esac
done

python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<20}{'out tok/s':>11}{'step ms':>9}{'host %':>8}{'sched':>7}{'exec':>7}{'post':>7}{'fwd dev':>8}{'graph steps':>12}{'% floor':>9}{'errors':>7}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    try:
        record = json.loads(path.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{path.stem[6:]:<20} (no record)"); continue
    for r in record["runs"]:
        t = r["time_split"]; roof = r["roofline"] or {}
        name = path.stem[6:] + (f" [{r['label']}]" if len(record["runs"]) > 1 else "")
        print(f"{name:<20}{r['output_tokens_per_s']:>11,.0f}{t['step_ms']:>9.2f}"
              f"{t['host_ms'] / t['step_ms']:>8.0%}{t['schedule_ms']:>7.2f}{t['execute_ms']:>7.2f}"
              f"{t['postprocess_ms']:>7.2f}{t['forward_device_ms'] or 0:>8.2f}{t['num_cuda_graph_steps']:>12}"
              f"{roof.get('fraction_of_floor', 0):>9.1%}{r.get('num_errors', 0):>7}")
print("commit", record.get("git_commit"), "device", record.get("device"))
PY
# At most 8 files come back from the device: the records travel as one archive.
tar czf "$OUT/bench_records.tgz" -C "$OUT" $(cd "$OUT" && ls bench_*.json bench_*.err) && rm -f "$OUT"/bench_*.err "$OUT"/bench_*.json
