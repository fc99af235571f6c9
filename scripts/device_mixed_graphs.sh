#!/usr/bin/env bash
# Mixed-step CUDA graphs (offline_paged/worker/mixed_graphs.py, issue 23 item 1) on the device.
#   tests: their GPU tests and the decode graphs' (-x, stops at the first failure)
#   ab:    1B bench, N requests (default 1024), mixed-step graphs on (a) / off (b: --mixed-graph-tokens 0; or
#          A_FLAGS / B_FLAGS of your own, e.g. A_FLAGS="--mixed-graph-tokens 8192" B_FLAGS="--mixed-graph-tokens 2048"),
#          interleaved, for each admission batch in ADMISSIONS (default "1 default": one admits a prompt as soon as
#          a slot frees, so many small prefilling steps; the other the engine's default batch); then per kind of
#          kind of step (decode graph, prefill graph, eager; the bench's step_kinds) the mean host launch (execute),
#          device forward and step wall time.
#   profile: cProfile of the main thread over one such bench (mixed-step graphs on, the first admission batch of
#          ADMISSIONS): the runner's calls by cumulative time, then the top functions by own time.
# Usage: OUT=/tmp/out [N=1024] [PRESET=llama-3.2-1b] [ADMISSIONS="1 default"] [REPEATS=1] \
#        scripts/device_mixed_graphs.sh [tests|ab|profile|all]  (all: tests, then ab)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mixed-out}
MODE=${1:-all}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  timeout ${TEST_LIMIT:-360} python3 -m pytest -q -x -p no:cacheprovider tests/test_mixed_graphs.py \
    tests/test_cuda_graph_runner.py 2>&1 | tail -25
fi
if [ "$MODE" = ab ] || [ "$MODE" = all ]; then
  for admission in ${ADMISSIONS:-1 default}; do
    flag=""; [ "$admission" != default ] && flag="--admission-batch $admission"
    mkdir -p "$OUT/adm_$admission"
    echo "== admission batch $admission"
    OUT="$OUT/adm_$admission" PRESET=${PRESET:-llama-3.2-1b} A_FLAGS=${A_FLAGS:-} \
      B_FLAGS=${B_FLAGS:---mixed-graph-tokens 0} REPEATS=${REPEATS:-1} \
      EXTRA="--num-requests ${N:-1024} $flag" BENCH_LIMIT=${BENCH_LIMIT:-150} bash scripts/device_ab.sh
    tar xzf "$OUT/adm_$admission/ab_records.tgz" -C "$OUT/adm_$admission"
    python3 - "$OUT/adm_$admission" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("ab_*.json")):
    try:
        kinds = json.loads(path.read_text().strip().splitlines()[-1])["runs"][0]["step_kinds"]
    except (ValueError, IndexError, KeyError):
        continue
    for kind, k in kinds.items():
        print(f"{path.stem:<8}{kind}: {k['num_steps']} steps, {k['tokens']:.0f} tokens, wall {k['wall_ms']:.2f} ms, "
              f"execute (host launch) {k['execute_ms']:.2f} ms, forward {k['forward_device_ms']:.2f} ms, "
              f"host-only {k['host_only_share']:.0%}")
PY
    rm -f "$OUT/adm_$admission"/ab_*.json "$OUT/adm_$admission"/ab_*.err
  done
fi
if [ "$MODE" = profile ]; then
  admission=$(echo ${ADMISSIONS:-1} | cut -d' ' -f1)
  flag=""; [ "$admission" != default ] && flag="--admission-batch $admission"
  timeout ${BENCH_LIMIT:-150} python3 -m cProfile -o "$OUT/bench.prof" "$(command -v offline-paged)" bench --device cuda \
    --dummy-weights ${PRESET:-llama-3.2-1b} --num-requests ${N:-1024} $flag ${EXTRA:-} 2>"$OUT/profile.err" | tail -4
  python3 - "$OUT/bench.prof" <<'PY'
import pstats, sys
stats = pstats.Stats(sys.argv[1])
wanted = ("launch", "_launch_eager", "_launch_graph_sampled", "run", "pack_eager", "unpack_eager", "attention",
          "paged_attention", "_launch_sampling", "sample_async", "logits", "step_with_report", "schedule", "postprocess")
rows = [(ct, nc, f"{func[0].split('/')[-1]}:{func[2]}") for func, (cc, nc, tt, ct, callers) in stats.stats.items()
        if func[2] in wanted and ("offline_paged" in func[0] or "models" in func[0])]
print("cumulative s  calls  function")
for ct, nc, name in sorted(rows, reverse=True)[:25]:
    print(f"{ct:10.2f} {nc:7d}  {name}")
stats.sort_stats("tottime").print_stats(25)
PY
fi
