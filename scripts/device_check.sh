#!/usr/bin/env bash
# One device call's routine: install the carried wheels (.whl: llguidance, jsonschema, ... for the structured
# tests), run the GPU tests every session runs before landing (the CLI `generate` on the GPU and `bench` with
# CUDA graphs on and off among them), then bench runs, each record appended to one file: $OUT/records.jsonl,
# with its `call_label` (the device returns at most 8 files a call). A short table is printed last.
# Usage: OUT=/tmp/out [TESTS=1] [TEST_FILES="tests/..."] [PRESET=llama-3.2-1b] scripts/device_check.sh COMMIT \
#          'LABEL: bench args' ...
#   TEST_FILES replaces the default list (the files session 53's 118-test run took, 246 s on an H100).
#   e.g. scripts/device_check.sh $(git rev-parse --short HEAD) 'n1024_t2048: --num-requests 1024 --max-num-batched-tokens 2048'
#   COMMIT names the tree in the records (the device copy's .git is the session start's).
set -u
export PYTHONUNBUFFERED=1 OFFLINE_PAGED_GIT_COMMIT=${1:?the local HEAD, for the records}
shift
OUT=${OUT:-/tmp/check-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  # -v: each test's name in the log, so a run cut off by TESTS_LIMIT shows where it stopped (resume from there)
  read -ra files <<<"${TEST_FILES:-tests/test_gpu_engine.py tests/test_gpu_bench.py tests/test_graphs.py \
    tests/test_gpu_engine_fp8.py tests/test_cuda_graph_runner.py tests/test_mixed_graphs.py tests/test_gpu_structured.py \
    tests/test_gpu_async.py tests/test_gc_pacing.py}"
  timeout ${TESTS_LIMIT:-300} python3 -m pytest -v -x --durations=12 "${files[@]}" >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  echo "gpu tests rc=$rc $(tail -1 "$OUT/gpu_tests.log")"
  [ $rc = 124 ] && echo "cut off by TESTS_LIMIT in: $(grep -E '^tests/.*::' "$OUT/gpu_tests.log" | grep -vE \
    ' (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' | tail -1)"
fi
for run in "$@"; do
  label=${run%%:*}
  read -ra args <<<"${run#*:}"
  timeout ${BENCH_LIMIT:-120} offline-paged bench --device cuda --dummy-weights "${PRESET:-llama-3.2-1b}" --json "${args[@]}" \
    >/tmp/bench.json 2>/tmp/bench.err || { echo "$label FAILED"; tail -3 /tmp/bench.err; continue; }
  python3 -c "import json, sys; d = json.loads(open('/tmp/bench.json').read().strip().splitlines()[-1]); \
d['call_label'] = sys.argv[1]; print(json.dumps(d))" "$label" >>"$OUT/records.jsonl"
done
[ -f "$OUT/records.jsonl" ] || exit 0
python3 - "$OUT/records.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    record = json.loads(line)
    run, split = record["runs"][0], record["runs"][0]["time_split"]
    print(f"{record['call_label']:<20} seqs {run.get('max_num_seqs')} {run['output_tokens_per_s']:>9,.0f} tok/s "
          f"floor {(run['roofline'] or {}).get('fraction_of_floor', 0):.1%} steps {split['num_steps']} "
          f"eager {split['num_steps'] - split['num_cuda_graph_steps']} idle {split['device_idle_ms'] or 0:.3f} ms "
          f"preemptions {run['num_preemptions']} peak {(run['peak_device_memory_bytes'] or 0) / 1e9:.1f} GB "
          f"start {run.get('engine_start_s') or 0:.1f} s")
PY
