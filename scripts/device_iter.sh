#!/usr/bin/env bash
# One iteration on the device: the GPU tests named in TESTS, then planted bugs (PLANT: "file|sed expression|pytest -k"
# lines, each applied, its test run (it must FAIL), then reverted with git), then the benches
# in RUNS (scripts/device_throughput.sh bench) and the kernel profile of PRESETS (scripts/device_profile.sh).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/iter-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS >"$OUT/iter_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/iter_tests.log")"
  grep -E "^FAILED|^ERROR|Error" "$OUT/iter_tests.log" | head -20
fi
while IFS='|' read -r file expr selector; do
  [ -z "$file" ] && continue
  # The device's .git is not this tree's: restore from a copy, never with git checkout.
  cp "$file" /tmp/planted.orig
  sed -i "$expr" "$file"
  if cmp -s "$file" /tmp/planted.orig; then echo "PLANT did not apply: $file $expr"; continue; fi
  result=$(timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x $selector 2>&1 | tail -1)
  echo "planted [$expr] in $file -> $result"
  cp /tmp/planted.orig "$file"
done <<<"${PLANT:-}"
[ -n "${RUNS:-}" ] && OUT=$OUT RUNS="$RUNS" scripts/device_throughput.sh bench
[ -n "${PRESETS:-}" ] && OUT=$OUT PRESETS="$PRESETS" PHASE=profile TOP=${TOP:-22} scripts/device_profile.sh
exit 0
