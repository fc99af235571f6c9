#!/usr/bin/env bash
# A large job's steady state on the lent device machine: the 1B shape at N requests (default 1024) through
# `offline-paged bench --json`, one run per (max_num_seqs, admission batch, token budget), then a short table.
# Records go to $OUT/ss_<label>.json. An admission batch of "auto" leaves the default (max_num_seqs // 8).
# Usage: OUT=/tmp/out [N=1024] [PRESET=llama-3.2-1b] [DATASET=nano-vllm] [PAIRS="1:8192 16:8192 16:2048"] \
#        [SEQS="256"] [REPEAT=1] [DEVICE=cuda] scripts/device_steady_state.sh
# Runs of one repeat go in the order SEQS x PAIRS, so the repeats interleave the settings.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/steady-out}
N=${N:-1024}
PRESET=${PRESET:-llama-3.2-1b}
DATASET=${DATASET:-nano-vllm}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
for repeat in $(seq 1 "${REPEAT:-1}"); do
  for seqs in ${SEQS:-256}; do
    for pair in ${PAIRS:-"1:8192 16:8192 16:2048"}; do
      admission=${pair%%:*}; budget=${pair##*:}
      label="${PRESET}_${DATASET}_n${N}_s${seqs}_a${admission}_t${budget}_r${repeat}"
      flags=(--max-num-seqs "$seqs" --max-num-batched-tokens "$budget")
      [ "$admission" = auto ] || flags+=(--admission-batch "$admission")
      timeout ${LIMIT:-150} offline-paged bench --device "${DEVICE:-cuda}" --dummy-weights "$PRESET" \
        --dataset "$DATASET" --num-requests "$N" "${flags[@]}" --json \
        >"$OUT/ss_$label.json" 2>"$OUT/ss_$label.err" || { echo "$label FAILED"; tail -5 "$OUT/ss_$label.err"; }
    done
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<58}{'out tok/s':>11}{'floor':>8}{'steps':>7}{'eager':>7}{'idle ms':>9}{'host ms':>9}{'peak seqs':>10}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("ss_*.json")):
    try:
        run = json.loads(path.read_text())["runs"][0]
    except (ValueError, KeyError, IndexError):
        continue
    split, roof = run["time_split"], run["roofline"] or {}
    eager = split["num_steps"] - split["num_cuda_graph_steps"]
    print(f"{path.stem[3:]:<58}{run['output_tokens_per_s']:>11,.0f}{roof.get('fraction_of_floor', 0):>8.1%}"
          f"{split['num_steps']:>7}{eager:>7}{split['device_idle_ms'] or 0:>9.3f}{split['host_ms'] or 0:>9.3f}"
          f"{run['max_concurrent_seqs']:>10}")
PY
