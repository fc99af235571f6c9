#!/usr/bin/env bash
# Final GPU check on the lent device machine: install the tree, run every GPU test (the CLI job on the GPU
# is one of them, in tests/test_gpu_engine.py), then time the default bench workload on the
# 1B shape.
# Usage: OUT=/tmp/out scripts/device_all.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/all-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_launchers.py tests/test_swap.py tests/test_ops_cuda.py tests/test_gpu_sampler.py \
  tests/test_sampling_launcher.py tests/test_gpu_engine.py \
  >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
grep -E "FAILED|Error" "$OUT/gpu_tests.log" | head -20

# Twice, so the run-to-run noise of one machine is visible next to the figure.
for run in 1 2; do
  timeout 150 offline-paged bench --dummy-weights llama-3.2-1b --device cuda >"$OUT/bench$run.txt" 2>&1
  echo "== bench run $run"; tail -32 "$OUT/bench$run.txt"
done
