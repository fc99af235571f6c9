#!/usr/bin/env bash
# Issue 6's remaining measurements in one device call: block-size sweep and a memory-bound paged vs
# contiguous comparison on the Llama-3.2-1B shape, then the Llama-3.1-8B shape. Default random workload
# (N=256, 100-1024 in/out, seed 0), CUDA graphs on. Each part writes its table to $OUT as it finishes.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sweep-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
part() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" offline-paged bench "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name (rc $?)"; grep -E "^(run|paged|contiguous)|out tok/s|per step|KV util|peak device" "$OUT/$name.txt" | head -20
}
part sweep_1b 90 --dummy-weights llama-3.2-1b --block-size 8 --block-size 16 --block-size 32 --block-size 64 --no-roofline
part tight_1b 70 --dummy-weights llama-3.2-1b --kv-layout paged --kv-layout contiguous --kv-cache-memory 4GiB --no-roofline
part shape_8b 80 --dummy-weights llama-3.1-8b --no-roofline
