#!/usr/bin/env bash
# GPU-backend driver for the lent device machine: install the package, run the gpu tests, watch a planted
# kernel bug fail its test, run the kernel benchmark. Usage: scripts/device_gpu.sh STAGE...
# Stages: env kernels plant ops bench bench-quick. Logs go under $OUT (default /tmp/gpu-out);
# a short status table is printed last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STATUS=()
note() { STATUS+=("$(printf '%-12s %s' "$1" "$2")"); }

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

for stage in "$@"; do
  case "$stage" in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/env.log"
      python3 - <<'PY' 2>&1 | tee -a "$OUT/env.log"
import cupy
print("cupy", cupy.__version__, "cc", cupy.cuda.Device().compute_capability,
      "SMs", cupy.cuda.Device().attributes["MultiProcessorCount"])
src = 'extern "C" __global__ void probe(float* x) { x[0] = 1.f; }'
for opts in (("--std=c++17",), ("--std=c++17", "-arch=sm_90")):
    try:
        cupy.RawModule(code=src, options=opts).get_function("probe")
        print("RawModule options", opts, "compile: ok")
    except Exception as exc:
        print("RawModule options", opts, "compile: FAILED", str(exc).splitlines()[0][:200])
PY
      python3 -c "import cupy; print('import cupy from the repo root: ok')" 2>&1 | tail -1 | tee -a "$OUT/env.log"
      note env done ;;
    kernels)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_launchers.py 2>&1 | tee "$OUT/kernels.log" | tail -25
      note kernels "$(tail -1 "$OUT/kernels.log")" ;;
    plant)
      # Throwaway: compile patched copies of attention.cu (causal mask off by one; wrong block offset) and
      # check that the decode / prefill tests go red. Product code is untouched.
      python3 - <<'PY' 2>&1 | tee "$OUT/plant.log" | tail -12
import pytest
import offline_paged.ops.kernel_modules as modules
original = modules.read_source
bugs = {"causal mask p <= pos -> p < pos": ("p <= pos", "p < pos"),
        "chunk slot base + (p - k0) -> base + (p - k0 + 1)": ("slot = base + (p - k0);", "slot = base + (p - k0 + 1);"),
        "table lookup p % B -> (p + 1) % B": ("p % P.block_size", "(p + 1) % P.block_size")}
for label, (old, new) in bugs.items():
    assert original("attention.cu").count(old) >= 1, old
    modules.read_source = lambda f, old=old, new=new: original(f).replace(old, new) if f == "attention.cu" else original(f)
    modules.clear_cache()
    rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/test_launchers.py", "-k",
                      "decode_attention_matches_reference or prefill_and_chunked"])
    print(f"PLANTED [{label}]: pytest rc={int(rc)} ->", "CAUGHT (tests failed)" if int(rc) == 1 else "NOT CAUGHT")
modules.read_source = original
modules.clear_cache()
PY
      note plant "$(grep -c CAUGHT\ \(tests "$OUT/plant.log") of 3 planted bugs caught" ;;
    ops)
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_ops_cuda.py 2>&1 | tee "$OUT/ops.log" | tail -25
      note ops "$(tail -1 "$OUT/ops.log")" ;;
    bench)
      python3 benchmarks/bench_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -80
      note bench "$(grep 'batch\*context' "$OUT/bench.log")" ;;
    bench-quick)
      python3 benchmarks/bench_kernels.py --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -40
      note bench-quick "$(grep 'batch\*context' "$OUT/bench.log")" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "==== summary ===="
printf '%s\n' "${STATUS[@]}"
