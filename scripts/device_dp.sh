#!/usr/bin/env bash
# Data-parallel throughput on the lent two-GPU machine (nvidia-h200-x2), in one call:
#   1. the DP tests that run on a CPU (they also run in `make test`) as a smoke check of spawn here;
#   2. `offline-paged bench --data-parallel-size 2 --compare-single --json` on the default workload
#      scaled to N=512, 1B and 8B shapes: one engine process, then two, same workload, same call.
#      Records go to $OUT/dp_*.json (stderr, with each worker's pid and GPU, to $OUT/dp_*.err);
#   3. a short table: out tok/s of one and two engines and the ratio (target >= 1.9x).
# Usage: OUT=/tmp/out [RUNS="1b 8b"] scripts/device_dp.sh [tests|bench|all]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dp-out}
WHAT=${1:-all}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

if [ "$WHAT" != bench ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -x tests/test_dp_coordinator.py \
    tests/test_dp_bench.py >"$OUT/dp_tests.log" 2>&1
  echo "dp tests: $(tail -1 "$OUT/dp_tests.log")"
fi
[ "$WHAT" = tests ] && exit 0

RUNS=${RUNS:-1b 8b}
for name in $RUNS; do
  case $name in
    1b) preset=llama-3.2-1b ;;
    8b) preset=llama-3.1-8b ;;
    *) echo "unknown run $name"; continue ;;
  esac
  timeout 270 offline-paged bench --device cuda --dummy-weights $preset \
    --num-requests 512 --data-parallel-size 2 --compare-single --json \
    >"$OUT/dp_$name.json" 2>"$OUT/dp_$name.err" || { echo "bench $name FAILED"; tail -5 "$OUT/dp_$name.err"; }
done

python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<6}{'1 engine tok/s':>16}{'2 engines tok/s':>17}{'ratio':>8}{'wall 1':>9}{'wall 2':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("dp_*.json")):
    try:
        record = json.loads(path.read_text().strip().splitlines()[-1])
        one, two = record["runs"]
    except (ValueError, IndexError, KeyError):
        print(f"{path.stem[3:]:<6} (no record)"); continue
    print(f"{path.stem[3:]:<6}{one['output_tokens_per_s']:>16,.0f}{two['output_tokens_per_s']:>17,.0f}"
          f"{two['output_tokens_per_s'] / one['output_tokens_per_s']:>7.2f}x{one['wall_s']:>9.1f}{two['wall_s']:>9.1f}")
print("commit", record.get("git_commit"), "device", record.get("device"))
PY
