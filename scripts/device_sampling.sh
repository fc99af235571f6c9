#!/usr/bin/env bash
# GPU-sampler driver for the lent device machine: install, run the GpuSampler tests against the NumPy sampler,
# time the engine with host vs device sampling, plant kernel bugs in a throwaway patched source and watch the
# tests fail, run the GPU engine tests (now sampling on the device). Usage: scripts/device_sampling.sh STAGE...
# Stages: tests bench plant engine.
# Logs go under $OUT (default /tmp/sampling-out); a summary is printed last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sampling-out}
mkdir -p "$OUT"
STATUS=()
note() { STATUS+=("$(printf '%-8s %s' "$1" "$2")"); }

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

for stage in "$@"; do
  case "$stage" in
    tests)
      timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_sampler.py tests/test_sampling_launcher.py 2>&1 \
        | tee "$OUT/tests.log" | grep -E "ids equal|passed|failed|Error|error|assert" | tail -60
      note tests "$(tail -1 "$OUT/tests.log")" ;;
    bench)
      PYTHONPATH=tests timeout 200 python3 - <<'PY' 2>&1 | tee "$OUT/bench.log"
import sys, time
import cupy
import numpy as np
from test_ops_cuda import SMOLLM2_SHAPE
from test_gpu_engine import random_model
from offline_paged.core.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.worker.gpu_sampler import GpuSampler
from offline_paged.worker.sampler import Sampler, SamplingRequest
from offline_paged.core.sampling_params import SamplingParams

# the sampler alone on 64 rows of vocab 49152 (host: includes the [64, V] download it needs)
rng = np.random.default_rng(0)
logits = cupy.asarray(rng.normal(size=(64, 49152)).astype(np.float32) * 3)
for label, params in [("greedy", SamplingParams(temperature=0.0)), ("T=0.8", SamplingParams(temperature=0.8)),
                      ("top_p=0.95", SamplingParams(temperature=0.8, top_p=0.95)),
                      ("top_k=50+penalties", SamplingParams(top_k=50, repetition_penalty=1.1))]:
    reqs = [SamplingRequest(params, i, 5, list(range(128)), list(range(200, 300))) for i in range(64)]
    for name, fn in [("gpu", lambda: GpuSampler().sample(logits, list(range(64)), reqs)),
                     ("host", lambda: Sampler().sample(logits.get(), reqs))]:
        fn(); cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        print(f"sampler alone {label:20s} {name:4s}: {(time.perf_counter() - start) / 5 * 1e3:7.2f} ms per 64-row step")

model = random_model(SMOLLM2_SHAPE)  # all 30 layers
engine = LLMEngine(EngineConfig(device="cuda", max_num_seqs=64, max_model_len=2048), loaded_model=model)
device_sampler = engine.runner.gpu_sampler

def run(num, tag, params):
    for i in range(num):
        p = params if params.temperature == 0 else SamplingParams(**{**params.to_dict(), "seed": i})
        engine.add_request(f"{tag}{i}", prompt_token_ids=rng.integers(0, 49152, 128).tolist(), params=p)
    steps, start, outs = 0, time.perf_counter(), []
    while engine.has_unfinished_requests():
        outs += engine.step()
        steps += 1
    return time.perf_counter() - start, steps

for label, params in [("greedy", SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)),
                      ("seeded T=0.8 top_p=0.95", SamplingParams(max_tokens=128, temperature=0.8, top_p=0.95,
                                                                ignore_eos=True))]:
    for where, sampler in [("host", None), ("device", device_sampler)]:
        engine.runner.gpu_sampler = sampler  # what ModelRunner(device_sampling=False) builds
        run(2, "warm", params)
        seconds, steps = run(64, f"{label}{where}", params)
        print(f"ENGINE 64 x (128 prompt + 128 generated) {label:24s} {where:6s} sampling: {seconds:.2f} s, "
              f"{steps} steps, {64 * 128 / seconds:.0f} generated tok/s")
PY
      note bench "$(grep -c ENGINE "$OUT/bench.log") engine timings" ;;
    plant)
      # Throwaway: patched copies of sampling.cu through modules.read_source; product code is untouched.
      timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/plant.log" | grep -E "PLANTED"
import pytest
import offline_paged.ops.kernel_modules as modules
original = modules.read_source
bugs = {"top-k/top-p cut drops the boundary token (x >= c -> x > c)": ("x >= c", "x > c"),
        "random stream position multiplier off by one": ("position * 0xBF58476D1CE4E5B9ULL", "position * 0xBF58476D1CE4E5B8ULL"),
        "repetition penalty divides negatives too": ("value > 0.0 ? __ddiv_rn(value, rep)", "value > -1e300 ? __ddiv_rn(value, rep)")}
for label, (old, new) in bugs.items():
    assert original("sampling.cu").count(old) >= 1, old
    modules.read_source = lambda f, old=old, new=new: original(f).replace(old, new) if f == "sampling.cu" else original(f)
    modules.clear_cache()
    rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/test_gpu_sampler.py", "-k",
                      "each_config and 50 and (top_k or temperature or penalties)"])
    print(f"PLANTED [{label}]: pytest rc={int(rc)} ->", "CAUGHT (tests failed)" if int(rc) == 1 else "NOT CAUGHT")
modules.read_source = original
modules.clear_cache()
PY
      note plant "$(grep -c 'CAUGHT (tests' "$OUT/plant.log") of 3 planted bugs caught" ;;
    engine)
      timeout ${ENGINE_TIMEOUT:-150} python3 -m pytest -q -s -x -m gpu -p no:cacheprovider tests/test_gpu_engine.py 2>&1 \
        | tee "$OUT/engine.log" | grep -E "agreement|passed|failed|Error|error" | tail -20
      note engine "$(tail -1 "$OUT/engine.log")" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "==== summary ===="
printf '%s\n' "${STATUS[@]}"
