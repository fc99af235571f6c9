#!/usr/bin/env bash
# Structured output on the lent device, in one call: the 1B bench with every request JSON-constrained,
# masks filled in this process (0) and by mask processes (8), each beside the plain run, interleaved
# --repeat times; then a table with the mask server's waits.
# Usage: OUT=/tmp/out [REPEAT=3] [COUNTS="0 8"] [LENGTHS=short|default] [NAME=bench_structured] [BENCH=offline-paged]
#   [COMMIT=abc1234]
#   scripts/device_structured.sh
#   COUNTS: the --grammar-mask-processes values, one JSON run each per repeat (the like-for-like run follows them);
#   LENGTHS=default: the bench's own lengths (100..1024 in and out) instead of the short 64:128 / 128:192.
#   NAME: the record's file name ($OUT/NAME.json; its stderr in /tmp/NAME.err);
#   BENCH: the command that runs `offline-paged`;
#   COMMIT: the local HEAD the records name (the device copy's .git is the session start's).
set -u
export PYTHONUNBUFFERED=1
[ -n "${COMMIT:-}" ] && export OFFLINE_PAGED_GIT_COMMIT=$COMMIT
OUT=${OUT:-/tmp/structured-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip-structured.log 2>&1 \
  || { tail -20 /tmp/pip-structured.log; exit 1; }
# The host paces the JSON step (its mask workers): name it beside the figures.
echo "host: $(nproc) CPUs, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)"
# Whether the mask workers share physical cores with the step loop (SMT siblings): the session 43 hypothesis.
lscpu 2>/dev/null | grep -E '^(Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)):' | tr -s ' ' | paste -sd';'
lengths="--input-len 64:128 --output-len 128:192"
[ "${LENGTHS:-short}" = default ] && lengths=""
counts=""
for count in ${COUNTS:-0 ${PROCESSES:-8}}; do counts="$counts --grammar-mask-processes $count"; done
name=${NAME:-bench_structured}
timeout ${BENCH_LIMIT:-400} ${BENCH:-offline-paged} bench --device cuda --json --dummy-weights llama-3.2-1b \
  --cuda-graphs $lengths --structured json $counts --repeat ${REPEAT:-3} >"$OUT/$name.json" 2>"/tmp/$name.err" \
  || tail -5 "/tmp/$name.err"
python3 - "$OUT/$name.json" <<'PY'
import json, sys
record = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
# like for like: each run's out tok/s over its repeat's "plain@json lengths" run (the same output lengths)
reference = {r["label"].partition(" plain@json lengths")[2]: r["output_tokens_per_s"] for r in record["runs"]
             if " plain@json lengths" in r["label"]}
print(f"{'run':<30}{'out tok/s':>10}{'like4like':>10}{'step ms':>9}{'sched':>7}{'exec':>7}{'post':>7}{'tok wait':>9}"
      f"{'dispatch':>9}{'fwd dev':>8}{'outcome wait':>13}{'mask wait':>10}{'errors':>7}{'loop cpu':>9}{'invol':>6}"
      f"{'steal':>6}{'cpus':>7}")
for r in record["runs"]:
    t, m = r["time_split"], r.get("mask_server") or {}
    base = reference.get(r["label"][r["label"].rfind(" #"):] if " #" in r["label"] else "")
    like = f"{r['output_tokens_per_s'] / base:>10.3f}" if base else f"{'-':>10}"
    print(f"{r['label']:<30}{r['output_tokens_per_s']:>10,.0f}{like}{t['step_ms']:>9.2f}{t['schedule_ms']:>7.2f}"
          f"{t['execute_ms']:>7.2f}{t['postprocess_ms']:>7.2f}{t.get('token_wait_ms', 0):>9.2f}"
          f"{t.get('mask_dispatch_ms', 0):>9.2f}{t['forward_device_ms'] or 0:>8.2f}"
          f"{m.get('outcome_wait_ms', float('nan')):>13.2f}{m.get('mask_wait_ms', float('nan')):>10.2f}"
          f"{r.get('num_errors', 0):>7}"  # requests ended by a grammar error: a masking bug shows here first
          # the step loop thread's CPU ms and involuntary switches a step, the host's steal (host_load.py)
          + (f"{h['thread_cpu_ms']:>9.2f}{h['involuntary_switches'] or 0:>6.2f}{h['host_steal_share'] or 0:>6.1%}"
             f"{h['cpu_first']!s:>4}>{h['cpu_last']!s:<2}" if (h := r.get("host_load")) else ""))
print("commit", record.get("git_commit"), "device", record.get("device"))
PY
