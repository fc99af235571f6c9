#!/usr/bin/env bash
# GPU-engine driver for the lent device machine: install, run the GPU engine tests (and the CudaOps
# tests), plant runner bugs in a throwaway patched copy and watch their tests fail, then time a 64-request
# greedy job on a SmolLM2-shaped random model (printed last). Usage: scripts/device_engine.sh STAGE...
# Stages: tests plant bench.
# Logs go under $OUT (default /tmp/engine-out).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/engine-out}
mkdir -p "$OUT"
STATUS=()
note() { STATUS+=("$(printf '%-8s %s' "$1" "$2")"); }

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

for stage in "$@"; do
  case "$stage" in
    tests)
      timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider ${ENGINE_TESTS:-tests/test_gpu_engine.py tests/test_ops_cuda.py} \
        2>&1 | tee "$OUT/tests.log" | grep -E "agreement|preemption=|passed|failed|Error|error" | tail -30
      note tests "$(tail -1 "$OUT/tests.log")" ;;
    plant)
      # Throwaway: exec a patched copy of runner.py and graft its methods onto ModelRunner in this process;
      # product code is untouched. Each bug must turn its test red.
      timeout 200 python3 - <<'PY' 2>&1 | tee "$OUT/plant.log" | grep -E "PLANTED"
import inspect
import sys
import types
import pytest
import offline_paged.worker.model_runner as runner
source = inspect.getsource(runner)
bugs = {
    "max_context_len from the cached prefix, not the context": (
        "max_context_len=int(context_lens.max())", "max_context_len=int(starts.max()) + 1",
        "_prepare", "teacher_forced and smollm2"),
    "swap_in pairs the CPU blocks in reverse": (
        "self.swapper.swap_in(cpu_ids, device_ids)", "self.swapper.swap_in(cpu_ids[::-1], device_ids)",
        "swap_in", "preempted"),
}
for label, (old, new, method, tests) in bugs.items():
    assert source.count(old) == 1, old
    patched = sys.modules["patched_runner"] = types.ModuleType("patched_runner")  # dataclasses look it up
    exec(compile(source.replace(old, new), "patched_runner.py", "exec"), patched.__dict__)
    original = getattr(runner.ModelRunner, method)
    setattr(runner.ModelRunner, method, getattr(patched.ModelRunner, method))
    rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/test_gpu_engine.py", "-k", tests])
    setattr(runner.ModelRunner, method, original)
    print(f"PLANTED [{label}]: pytest rc={int(rc)} ->", "CAUGHT (tests failed)" if int(rc) == 1 else "NOT CAUGHT")
PY
      note plant "$(grep -c 'CAUGHT (tests' "$OUT/plant.log") of 2 planted bugs caught" ;;
    bench)
      PYTHONPATH=tests timeout 240 python3 - <<'PY' 2>&1 | tee "$OUT/bench.log" | tail -6
import sys, time
import numpy as np
from test_gpu_engine import SHAPES, random_model
from test_ops_cuda import SMOLLM2_SHAPE
from offline_paged.core.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.core.sampling_params import SamplingParams

model = random_model(SMOLLM2_SHAPE)  # all 30 layers
engine = LLMEngine(EngineConfig(device="cuda", max_num_seqs=64, max_model_len=2048), loaded_model=model)
print(f"KV pool from free memory x 0.9: {engine.num_gpu_blocks} blocks of 16 "
      f"({engine.num_gpu_blocks * 16} tokens)")
rng = np.random.default_rng(0)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)

def run(num, tag):
    for i in range(num):
        engine.add_request(f"{tag}{i}", prompt_token_ids=rng.integers(0, 49152, 128).tolist(), params=params)
    done, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        done += len(engine.step())
        steps += 1
    return time.perf_counter() - start, steps

run(2, "warm")  # kernel compiles
seconds, steps = run(64, "r")
print(f"64 requests x (128 prompt + 128 generated) greedy, SmolLM2 shape (30 layers, fp16): {seconds:.2f} s, "
      f"{steps} steps, {64 * 128 / seconds:.0f} generated tok/s, {64 * 256 / seconds:.0f} total tok/s")
PY
      note bench "$(tail -1 "$OUT/bench.log")" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "==== summary ===="
printf '%s\n' "${STATUS[@]}"
