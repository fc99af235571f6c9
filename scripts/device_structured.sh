#!/usr/bin/env bash
# Structured output on the lent device machine: the GPU mask tests, then the 1B bench plain vs every request
# JSON-constrained (issue 24's >= 85% figure). The device image lacks llguidance: carry its wheel as .whl/
# (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64
# -d .whl llguidance==1.9.1; .whl/ is git-ignored) and name .whl in the run's carry.
# Usage: scripts/device_structured.sh   (logs under $OUT, default /tmp/structured-out)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/structured-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "carry the llguidance wheel in .whl/"; exit 5; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_structured.py 2>&1 | tee "$OUT/tests.log" | tail -8
timeout 300 python3 -c "from offline_paged.cli.main import cli; cli()" bench --dummy-weights llama-3.2-1b \
  --num-requests 256 --input-len 64:128 --output-len 128:192 --structured json --no-roofline 2>&1 \
  | tee "$OUT/bench.log" | head -14
