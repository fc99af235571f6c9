#!/usr/bin/env bash
# The 8-row "decode" attention tiles (rows as the mma's N dimension) against the 16-row key-split tiles, on the
# lent device machine, in one call:
#   kernels  decode attention alone (bench_decode_splits.py, launch order as the graphs run it, 256 sequences of
#            100..1900 tokens): both kernels at the 8B (D = 128, G = 4), Qwen3-0.6B (D = 128, G = 2) and 1B
#            (D = 64, G = 4) shapes in bf16, and over an FP8 pool; max|diff| is against the first kernel's output;
#   tests    the attention kernels' GPU tests (16-bit and FP8) and the launcher's choice;
#   profile  benchmarks/profile_kernels.py per preset in PROFILE_PRESETS, with each tile;
#   engine   `offline-paged bench --json --cuda-graphs` per preset in ENGINE_PRESETS, with the launcher's choice
#            (decode tiles) and then with key-split tiles forced by a device-side edit of launchers.py (undone
#            after), REPEATS times interleaved; a table at the end, the records (bench_<preset>_<kernel>_<i>.json) in
#            $OUT/records.tgz (a call brings back only a few files).
# Usage: OUT=/tmp/out [ENGINE_PRESETS="llama-3.1-8b qwen3-0.6b llama-3.2-1b"] [REPEATS=1] [KERNEL_DTYPE=bfloat16]
#        scripts/device_decode_tiles.sh [kernels tests profile engine]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode-tiles-out}
STEPS=${*:-kernels tests engine}
RECORDS=/tmp/decode-tiles-records  # logs and records; the records come back as one archive
mkdir -p "$OUT" "$RECORDS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the device image lacks, carried as .whl/ (git-ignored)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$RECORDS/pip.log" 2>&1 \
  || { tail -20 "$RECORDS/pip.log"; exit 1; }

splits() {  # bench_decode_splits.py flags
  timeout ${KERNEL_LIMIT:-150} env PYTHONPATH="benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_decode_splits.py \
    --order launch-order --splits plan --dtype ${KERNEL_DTYPE:-bfloat16} --kernels keysplit decode "$@" 2>&1 \
    | grep -v "^\s*$" || echo "bench_decode_splits $* FAILED"
}
if [[ " $STEPS " == *" kernels "* ]]; then
  splits --head-dim 128 --num-heads 32 --variants default ${D128_VARIANTS:-dec_uncapped}
  splits --head-dim 128 --num-heads 16
  splits --head-dim 64 --num-heads 32
  splits --head-dim 128 --num-heads 32 --kv-cache-dtype fp8 --variants default ${FP8_VARIANTS:-dec_uncapped dec_fp8cap3}
  splits --head-dim 64 --num-heads 32 --kv-cache-dtype fp8
fi

if [[ " $STEPS " == *" tests "* ]]; then
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_launchers.py \
    tests/test_prefill_attention.py tests/test_ops_cuda_fp8.py ${EXTRA_TESTS:-} >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests (exit $?): $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -20
fi

CHOICE='return "keysplit" if rows > DECODE_TILE_ROWS else "decode"'
with_kernel() {  # decode|keysplit, then a command: runs it with the launcher's choice or with key-split tiles forced
  local kernel=$1; shift
  grep -q "$CHOICE" offline_paged/ops/launchers.py || { echo "launchers.py: the decode choice line moved"; return 1; }
  cp offline_paged/ops/launchers.py /tmp/launchers.py.orig  # (the device's git HEAD is not this tree)
  [ $kernel = keysplit ] && sed -i "s/$CHOICE/return \"keysplit\"/" offline_paged/ops/launchers.py
  "$@"; local status=$?
  cp /tmp/launchers.py.orig offline_paged/ops/launchers.py
  return $status
}

if [[ " $STEPS " == *" profile "* ]]; then  # where the device time goes, by kernel, with each tile
  for preset in ${PROFILE_PRESETS:-llama-3.2-1b}; do
    for kernel in decode keysplit; do
      echo "== profile $preset, $kernel tiles"
      with_kernel $kernel timeout 200 python3 benchmarks/profile_kernels.py --top ${TOP:-12} -- --dummy-weights $preset \
        --no-roofline --cuda-graphs 2>"$RECORDS/profile_${preset}_$kernel.err" | grep -A40 "kernel time over"
    done
  done
fi

if [[ " $STEPS " == *" engine "* ]]; then
  for preset in ${ENGINE_PRESETS:-llama-3.1-8b qwen3-0.6b llama-3.2-1b}; do
    for i in $(seq ${REPEATS:-1}); do  # interleaved, so drift in the machine's state hits both alike
      for kernel in decode keysplit; do
        name=bench_${preset}_${kernel}_$i
        PYTHONFAULTHANDLER=1 with_kernel $kernel timeout ${BENCH_LIMIT:-200} offline-paged bench --device cuda --json \
          --cuda-graphs --dummy-weights $preset ${BENCH_FLAGS:-} >"$RECORDS/$name.json" 2>"$RECORDS/$name.err" \
          || { echo "bench $preset $kernel FAILED"; tail -5 "$RECORDS/$name.err"; }
      done
    done
  done
  tar czf "$OUT/records.tgz" -C "$RECORDS" $(cd "$RECORDS" && ls bench_*.json)
  python3 - "$RECORDS" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
def run(path):
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])["runs"][0]
    except (OSError, ValueError, IndexError, KeyError):
        return None
print(f"{'preset':<14}{'#':>3}{'decode tok/s':>14}{'keysplit tok/s':>16}{'ratio':>8}{'fwd ms d/k':>14}{'% floor d/k':>14}")
for preset in sorted({p.stem.split("_")[1] for p in out.glob("bench_*_decode_*.json")}):
    ratios = []
    for path in sorted(out.glob(f"bench_{preset}_decode_*.json")):
        i = path.stem.rsplit("_", 1)[1]
        a, b = run(path), run(out / f"bench_{preset}_keysplit_{i}.json")
        if not a or not b:
            print(f"{preset:<14}{i:>3} (missing record)"); continue
        ratios.append(a["output_tokens_per_s"] / b["output_tokens_per_s"])
        fwd = f"{a['time_split']['forward_device_ms']:.2f}/{b['time_split']['forward_device_ms']:.2f}"
        floor = f"{a['roofline']['fraction_of_floor']:.1%}/{b['roofline']['fraction_of_floor']:.1%}"
        print(f"{preset:<14}{i:>3}{a['output_tokens_per_s']:>14,.0f}{b['output_tokens_per_s']:>16,.0f}"
              f"{ratios[-1]:>8.3f}{fwd:>14}{floor:>14}")
    if len(ratios) > 1:
        print(f"{preset:<14} median ratio {statistics.median(ratios):.3f}")
PY
fi
