#!/usr/bin/env bash
# The 8-row "decode" attention tiles (rows as the mma's N dimension) against the 16-row key-split tiles, on the
# lent device machine, in one call:
#   kernels  decode attention alone (bench_decode_splits.py, launch order as the graphs run it, 256 sequences of
#            100..1900 tokens): both kernels at the 8B (D = 128, G = 4), Qwen3-0.6B (D = 128, G = 2) and 1B
#            (D = 64, G = 4) shapes in bf16, and over an FP8 pool; max|diff| is against the first kernel's output;
#   tests    the attention kernels' GPU tests (16-bit and FP8) and the launcher's choice;
#   engine   `offline-paged bench --json --cuda-graphs` per preset in ENGINE_PRESETS, with the launcher's choice
#            (decode tiles) and then with key-split tiles forced by a device-side edit of launchers.py (undone
#            after), in one call; records in $OUT/bench_<preset>_<kernel>.json and a table at the end.
# Usage: OUT=/tmp/out [ENGINE_PRESETS="llama-3.1-8b qwen3-0.6b llama-3.2-1b"] scripts/device_decode_tiles.sh [kernels tests engine]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode-tiles-out}
STEPS=${*:-kernels tests engine}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the device image lacks, carried as .whl/ (git-ignored)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

splits() {  # bench_decode_splits.py flags
  timeout ${KERNEL_LIMIT:-150} env PYTHONPATH="benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_decode_splits.py \
    --order launch-order --splits plan --dtype bfloat16 --kernels keysplit decode "$@" 2>&1 | grep -v "^\s*$" \
    || echo "bench_decode_splits $* FAILED"
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

if [[ " $STEPS " == *" engine "* ]]; then
  CHOICE='return "keysplit" if rows > DECODE_TILE_ROWS else "decode"'
  grep -q "$CHOICE" offline_paged/ops/launchers.py || { echo "launchers.py: the decode choice line moved"; exit 1; }
  cp offline_paged/ops/launchers.py /tmp/launchers.py.orig  # (the device's git HEAD is not this tree)
  for preset in ${ENGINE_PRESETS:-llama-3.1-8b qwen3-0.6b llama-3.2-1b}; do
    for kernel in decode keysplit; do
      [ $kernel = keysplit ] && sed -i "s/$CHOICE/return \"keysplit\"/" offline_paged/ops/launchers.py
      PYTHONFAULTHANDLER=1 timeout ${BENCH_LIMIT:-200} offline-paged bench --device cuda --json --cuda-graphs \
        --dummy-weights $preset ${BENCH_FLAGS:-} >"$OUT/bench_${preset}_$kernel.json" 2>"$OUT/bench_${preset}_$kernel.err" \
        || { echo "bench $preset $kernel FAILED"; tail -5 "$OUT/bench_${preset}_$kernel.err"; }
      cp /tmp/launchers.py.orig offline_paged/ops/launchers.py
    done
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def record(path):
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
print(f"{'preset':<16}{'decode tok/s':>14}{'keysplit tok/s':>16}{'ratio':>8}{'decode % floor':>16}")
for path in sorted(out.glob("bench_*_decode.json")):
    preset = path.stem[len("bench_"):-len("_decode")]
    new, old = record(path), record(out / f"bench_{preset}_keysplit.json")
    if not new or not old:
        print(f"{preset:<16} (missing record)"); continue
    a, b = new["runs"][0], old["runs"][0]
    floor = a.get("roofline", {}).get("fraction_of_floor") if isinstance(a.get("roofline"), dict) else None
    print(f"{preset:<16}{a['output_tokens_per_s']:>14,.0f}{b['output_tokens_per_s']:>16,.0f}"
          f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:>8.3f}{'' if floor is None else f'{floor:.1%}':>16}")
PY
fi
