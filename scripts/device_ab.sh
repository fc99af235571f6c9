#!/usr/bin/env bash
# An engine A/B in one call: `offline-paged bench` (its defaults: async, CUDA graphs) on PRESET for the tree as it
# is (a) and with one device-side edit (b: the sed expression EDIT applied to FILE, undone after), REPEATS times
# interleaved (a b a b ...), then one line per run and the ratio of the medians b / a.
# Usage: OUT=/tmp/out PRESET=qwen3-0.6b FILE=offline_paged/ops/ops_cuda.py EDIT='s/old/new/' [REPEATS=2]
#        [EXTRA="--dtype bfloat16"] [BENCH_LIMIT=120] scripts/device_ab.sh
# Or b = the same tree with bench flags added: B_FLAGS="--mixed-graph-tokens 0" in place of FILE and EDIT (and
# A_FLAGS for a's own, e.g. A_FLAGS="--mixed-graph-tokens 8192" B_FLAGS="--mixed-graph-tokens 2048").
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ab-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
if [ -z "${B_FLAGS:-}" ]; then
  cp "$FILE" /tmp/ab.orig  # (the device's git HEAD is not this tree)
  sed "$EDIT" /tmp/ab.orig >/tmp/ab.edited
  cmp -s /tmp/ab.orig /tmp/ab.edited && { echo "EDIT changes nothing in $FILE"; exit 1; }
fi
for i in $(seq ${REPEATS:-2}); do
  for side in a b; do
    flags=${A_FLAGS:-}
    if [ $side = b ]; then
      if [ -n "${B_FLAGS:-}" ]; then flags=$B_FLAGS; else cp /tmp/ab.edited "$FILE"; fi
    fi
    PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-120} offline-paged bench --device cuda --json --dummy-weights "$PRESET" \
      ${EXTRA:-} $flags >"$OUT/ab_${side}_$i.json" 2>"$OUT/ab_${side}_$i.err" || { echo "bench $side $i FAILED"; tail -5 "$OUT/ab_${side}_$i.err"; }
    if [ -z "${B_FLAGS:-}" ]; then cp /tmp/ab.orig "$FILE"; fi
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
rates = {"a": [], "b": []}
for path in sorted(pathlib.Path(sys.argv[1]).glob("ab_*.json"), key=lambda p: p.stat().st_mtime):
    try:
        run = json.loads(path.read_text().strip().splitlines()[-1])["runs"][0]
    except (ValueError, IndexError, KeyError):
        print(f"{path.stem}: no record"); continue
    rates[path.stem.split("_")[1]].append(run["output_tokens_per_s"])
    split = run["time_split"]
    print(f"{path.stem:<8}{run['output_tokens_per_s']:>10,.0f} out tok/s, step {split['step_ms']:.3f} ms, forward "
          f"{split['forward_device_ms']:.3f} ms, {(run.get('roofline') or {}).get('fraction_of_floor', 0):.1%} of floor, "
          f"{split['num_steps']} steps, {split['num_steps'] - split['num_cuda_graph_steps']} eager, "
          f"{split.get('num_prefill_graph_steps', 0)} prefilling from graphs, idle {split['device_idle_ms']:.3f} ms")
if rates["a"] and rates["b"]:
    a, b = statistics.median(rates["a"]), statistics.median(rates["b"])
    print(f"medians: a {a:,.0f}, b {b:,.0f}, b / a = {b / a:.3f}")
PY
tar czf "$OUT/ab_records.tgz" -C "$OUT" $(cd "$OUT" && ls ab_*.json ab_*.err) && rm -f "$OUT"/ab_*.json "$OUT"/ab_*.err
