#!/usr/bin/env bash
# A large job's steady state on the lent device machine: the 1B shape at N requests (default 1024) through
# `offline-paged bench --json`, one run per (admission batch, token budget) pair, then a short table.
# Records go to $OUT/ss_<label>.json.
# Usage: OUT=/tmp/out [N=1024] [PRESET=llama-3.2-1b] [DATASET=nano-vllm] [PAIRS="1:8192 16:8192 16:2048"] \
#        scripts/device_steady_state.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/steady-out}
N=${N:-1024}
PRESET=${PRESET:-llama-3.2-1b}
DATASET=${DATASET:-nano-vllm}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
for pair in ${PAIRS:-"1:8192 16:8192 16:2048"}; do
  admission=${pair%%:*}; budget=${pair##*:}
  label="${PRESET}_${DATASET}_n${N}_a${admission}_t${budget}"
  timeout ${LIMIT:-150} offline-paged bench --device cuda --dummy-weights "$PRESET" --dataset "$DATASET" \
    --num-requests "$N" --admission-batch "$admission" --max-num-batched-tokens "$budget" --json \
    >"$OUT/ss_$label.json" 2>"$OUT/ss_$label.err" || { echo "$label FAILED"; tail -5 "$OUT/ss_$label.err"; }
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<48}{'out tok/s':>11}{'floor':>8}{'steps':>7}{'eager':>7}{'idle ms':>9}{'host ms':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("ss_*.json")):
    try:
        run = json.loads(path.read_text())["runs"][0]
    except (ValueError, KeyError, IndexError):
        continue
    split, roof = run["time_split"], run["roofline"] or {}
    eager = split["num_steps"] - split["num_cuda_graph_steps"]
    print(f"{path.stem[3:]:<48}{run['output_tokens_per_s']:>11,.0f}{roof.get('fraction_of_floor', 0):>8.1%}"
          f"{split['num_steps']:>7}{eager:>7}{split['device_idle_ms']:>9.3f}{split['host_ms']:>9.3f}")
PY
