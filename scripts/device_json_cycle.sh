#!/usr/bin/env bash
# Session 51's proposal on the device, in one call: the 1B JSON bench with LLMEngine.sample_before_ahead_launch on
# and off (scripts/knob_bench.py), ROUNDS interleaved rounds, each its own process and record
# ($OUT/json_before_rN.json, $OUT/json_in_launch_rN.json); then (PROFILE=1) benchmarks/profile_host.py --per-run on
# the JSON bench with the knob as the tree has it. The table of each record is device_structured.sh's.
# Usage: OUT=/tmp/out [COMMIT=abc1234] [ROUNDS=2] [PROFILE=1] [BENCH_LIMIT=110] scripts/device_json_cycle.sh
set -u
OUT=${OUT:-/tmp/json-cycle-out}
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD)}
knob=offline_paged.engine.LLMEngine.sample_before_ahead_launch
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in before:True in_launch:False; do
    echo "== round $round, ${knob##*.}=${side#*:}"
    BENCH="python3 scripts/knob_bench.py $knob=${side#*:}" NAME=json_${side%%:*}_r$round LENGTHS=default COUNTS=8 \
      REPEAT=1 BENCH_LIMIT=${BENCH_LIMIT:-110} OUT=$OUT scripts/device_structured.sh 2>&1 | grep -E "^paged|^run|rror"
  done
done
if [ "${PROFILE:-1}" = 1 ]; then
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site  # (device_structured.sh put the carried wheels there)
  echo "== profile_host.py --per-run (JSON, 8 mask processes)"
  OFFLINE_PAGED_GIT_COMMIT=$COMMIT timeout ${PROFILE_LIMIT:-150} python3 benchmarks/profile_host.py --per-run --top 40 \
    -- --dummy-weights llama-3.2-1b --cuda-graphs --structured json --grammar-mask-processes 8 >"$OUT/profile_json.txt" \
    2>/tmp/profile_json.err || tail -3 /tmp/profile_json.err
  grep -A45 "own time, us per step" "$OUT/profile_json.txt"
fi
