#!/usr/bin/env bash
# Ours beside vLLM 0.26.0 in one device call (issue 23's ratios): for each run, ours, then vLLM, then ours again,
# both engines at their defaults on the same workload. vLLM's carry (../shared/peers/vllm/README.md) travels in
# two chunks: carry .vcarry1 in an earlier call of the same warm machine and run `bash .vcarry1/append.sh
# .vcarry1/c1` there (it fits beside .whl and the tree); this call carries .vcarry2 and appends c2 itself.
# Usage: OUT=/tmp/out [COMMIT=abc1234] [RUNS="q06 1b"] [BENCH_LIMIT=90] scripts/device_vllm_pair.sh
#   RUNS: q06 (qwen3-0.6b), 1b (llama-3.2-1b), 8b (llama-3.1-8b), 1b1024 (the 1B at N = 1,024); N = 256 otherwise.
# Records: ours in $OUT/records.jsonl (labels RUN_before / RUN_after), vLLM's in $OUT/vllm_results.jsonl.
set -u
OUT=${OUT:-/tmp/vllm-pair-out}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD)}
mkdir -p "$OUT"
[ -f .vcarry2/c2 ] && bash .vcarry2/append.sh .vcarry2/c2 | tail -1
ours() {  # ours RUN LABEL
  local preset=llama-3.2-1b requests=256
  case $1 in
    q06) preset=qwen3-0.6b ;; 8b) preset=llama-3.1-8b ;; 1b1024) requests=1024 ;; 1b) ;;
    *) echo "device_vllm_pair.sh: unknown run $1 (q06, 1b, 8b, 1b1024)"; return 1 ;;
  esac
  TESTS=0 BENCH_LIMIT=${BENCH_LIMIT:-90} PRESET=$preset OUT=$OUT scripts/device_check.sh "$COMMIT" \
    "$1_$2: --num-requests $requests" | grep "^$1_$2 "
}
for run in ${RUNS:-q06 1b}; do
  ours "$run" before || continue
  RUNS="$run" OUT=$OUT bash .vcarry2/remote.sh 2>&1 | grep -E '^\{|FAILED|remote.sh' | cut -c1-200
  ours "$run" after
done
