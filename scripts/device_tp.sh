#!/usr/bin/env bash
# Tensor parallel on the lent two-GPU machine (nvidia-h200-x2):
#   tests: the CPU tensor-parallel tests (sharding arithmetic, the spawn + pipe protocol) and the
#          2-GPU tests over NCCL (sharded fp16 model vs one GPU on decisive positions, engine TP=2 vs
#          TP=1 greedy with graphs on and off, the bench CLI at TP=2);
#   bench: `offline-paged bench --json` on the default workload: the 8B shape at TP=1 and TP=2 in one
#          call (--compare-single), and the 70B shape (bf16) at TP=2. Records (with tensor_parallel_size,
#          kv_capacity_tokens and the per-GPU roofline floor) go to $RESULTS_DIR, named like
#          benchmarks/results/ (date_commit_name.json): copy them there and commit;
#   then a short table of the figures.
# NCCL_NVLS_ENABLE=0 (NVLink multicast off) is exported here and forced again in every process that
# creates a communicator. Spawned ranks inherit the environment.
# Usage: OUT=/tmp/out [RUNS="8b 70b"] scripts/device_tp.sh [tests|bench|all]
# The two halves fit one 10-minute call each: run `tests` and `bench` as separate calls.
set -u
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/tp-out}
RESULTS_DIR=${RESULTS_DIR:-$OUT/results}
WHAT=${1:-all}
mkdir -p "$OUT" "$RESULTS_DIR"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

if [ "$WHAT" != bench ]; then
  timeout 420 python3 -m pytest -q -s -p no:cacheprovider -x tests/test_tensor_parallel.py tests/test_tp_shard.py tests/test_tp_source.py \
    tests/test_tensor_parallel_engine.py tests/test_tensor_parallel_gpu.py >"$OUT/tp_tests.log" 2>&1
  echo "tp tests: $(tail -1 "$OUT/tp_tests.log")"
  grep -E "TP=2|greedy|FAILED|Error|error" "$OUT/tp_tests.log" | head -20
fi
[ "$WHAT" = tests ] && exit 0

stamp="$(date -u +%Y-%m-%d)_${OFFLINE_PAGED_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)}"
RUNS=${RUNS:-8b 70b}
for name in $RUNS; do
  case $name in
    8b) args=(--dummy-weights llama-3.1-8b --tensor-parallel-size 2 --compare-single); limit=300 ;;
    70b) args=(--dummy-weights llama-3.1-70b --dtype bfloat16 --tensor-parallel-size 2); limit=420 ;;
    *) echo "unknown run $name"; continue ;;
  esac
  record="$RESULTS_DIR/${stamp}_tp2_$name.json"
  timeout $limit offline-paged bench --device cuda --json "${args[@]}" >"$record" 2>"$OUT/tp_$name.err" \
    || { echo "bench $name FAILED"; tail -15 "$OUT/tp_$name.err"; }
done

python3 - "$RESULTS_DIR" <<'PY'
import json, pathlib, sys
print(f"{'record':<34}{'TP':>3}{'out tok/s':>11}{'floor tok/s':>12}{'% floor':>8}{'KV tokens':>11}{'wall s':>8}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*_tp2_*.json")):
    try:
        record = json.loads(path.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{path.stem:<34} (no record)"); continue
    for run in record["runs"]:
        roof = run.get("roofline") or {}
        print(f"{path.stem[-20:]:<34}{run['tensor_parallel_size']:>3}{run['output_tokens_per_s']:>11,.0f}"
              f"{roof.get('output_tokens_per_s_at_floor', float('nan')):>12,.0f}"
              f"{roof.get('fraction_of_floor', float('nan')):>8.1%}{run['kv_capacity_tokens']:>11,}{run['wall_s']:>8.1f}")
    print("  commit", record.get("git_commit"), "device", record.get("device"))
PY
