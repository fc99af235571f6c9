#!/usr/bin/env bash
# Session 52's open question on the device, in one call: why the JSON bench's step loop runs ~35% slower in some
# runs (benchmarks/NOTES.md, session 52). (1) scripts/cpu_sibling_probe.py on CPU 0 and the middle CPU: which CPUs
# slow them when busy (a VM's hidden hyperthread siblings); (2) ROUNDS interleaved rounds of the JSON bench, free
# placement against pin (the loop on CPU 0, the workers off it and off the CPUs the probe named for it), each run's
# record with its `host_load` (the loop thread's CPU ms and switches a step, the host's steal).
# Usage: OUT=/tmp/out [COMMIT=abc1234] [ROUNDS=2] scripts/device_host_load.sh
#   (carry .whl: device_structured.sh installs llguidance from it)
set -u
OUT=${OUT:-/tmp/host-load-out}
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD)} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
timeout 40 python3 scripts/cpu_sibling_probe.py --home 0 --home $(( $(nproc) / 2 )) --json >"$OUT/probe.txt" 2>&1
head -4 "$OUT/probe.txt"
avoid=$(tail -1 "$OUT/probe.txt" | python3 -c \
  "import json, sys; print(','.join(map(str, json.load(sys.stdin)['results'][0]['siblings'])))" 2>/dev/null)
echo "PIN_AVOID=$avoid"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in free pin; do
    echo "== round $round, $side"
    PIN_AVOID=$avoid BENCH="python3 scripts/mask_pin_bench.py $side" NAME=json_${side}_r$round LENGTHS=default \
      COUNTS=8 REPEAT=1 BENCH_LIMIT=${BENCH_LIMIT:-90} OUT=$OUT scripts/device_structured.sh 2>&1 \
      | grep -E "^paged|^run|rror|CPUs"
  done
done
