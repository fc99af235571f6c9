#!/usr/bin/env bash
# Where the device time goes, in one call: the kernel profile of a bench run (benchmarks/profile_kernels.py)
# for each preset named, then (PHASE includes hf) transformers' continuous batching on the same workload.
# Usage: OUT=/tmp/out PRESETS="llama-3.2-1b" PHASE="profile hf" scripts/device_profile.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/profile-out}
PHASE=${PHASE:-profile}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
if [[ $PHASE == *profile* ]]; then
  for preset in ${PRESETS:-llama-3.2-1b}; do
    echo "== profile $preset ${EXTRA:-}"
    timeout 240 python3 benchmarks/profile_kernels.py --top ${TOP:-30} -- --dummy-weights "$preset" --no-roofline ${EXTRA:-} \
      >"$OUT/profile_$preset.log" 2>"$OUT/profile_$preset.err"
    echo "exit status $?"; cat "$OUT/profile_$preset.log"; tail -5 "$OUT/profile_$preset.err"
  done
fi
if [[ $PHASE == *hf* ]]; then
  echo "== HF continuous batching"
  timeout 300 python3 -X faulthandler benchmarks/bench_hf_cb.py --preset llama-3.2-1b >"$OUT/hf_cb.json" 2>"$OUT/hf_cb.err"
  echo "exit status $?"; cat "$OUT/hf_cb.json"; tail -20 "$OUT/hf_cb.err"
fi
