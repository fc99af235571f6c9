#!/usr/bin/env bash
# Prefill attention (cuda/prefill_attention.cu) on the lent device machine: its GPU tests, planted bugs that
# must turn them red, the attention tests of the other kernels, and the TFLOP/s bench against the row-split
# kernel. Usage: scripts/device_prefill.sh STAGE... (stages: tests plant launchers bench). Logs go under $OUT
# (default /tmp/prefill-out); a short table is printed last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/prefill-out}
mkdir -p "$OUT"
STATUS=()
note() { STATUS+=("$(printf '%-10s %s' "$1" "$2")"); }

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

for stage in "$@"; do
  case "$stage" in
    tests)
      python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_prefill_attention.py 2>&1 | tee "$OUT/tests.log" | tail -15
      note tests "$(tail -1 "$OUT/tests.log")" ;;
    plant)
      # Throwaway patched copies of prefill_attention.cu; each must fail the prefill tests.
      python3 - <<'PY' 2>&1 | tee "$OUT/plant.log" | tail -8
import pytest
import offline_paged.ops.kernel_modules as modules
original = modules.read_source
bugs = {"causal mask p > pos -> p > pos + 1": ("if (p > pos ||", "if (p > pos + 1 ||"),
        "V read without its swizzle": ("const int piece = (2 * mp + (mat >> 1)) ^ r;", "const int piece = 2 * mp + (mat >> 1);"),
        "one rescale skipped (alpha_hi = 1)": ("alpha_hi = fast_exp2(st.m_hi - base_hi)", "alpha_hi = 1.f"),
        "diagonal tiles not masked": ("if (masked) {", "if (false) {")}
for label, (old, new) in bugs.items():
    assert original("prefill_attention.cu").count(old) == 1, old
    modules.read_source = lambda f, old=old, new=new: (original(f).replace(old, new) if f == "prefill_attention.cu"
                                                       else original(f))
    modules.clear_cache()
    rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/test_prefill_attention.py", "-k",
                      "mixed_batches or sliding_window"])
    print(f"PLANTED [{label}]: pytest rc={int(rc)} ->", "CAUGHT (tests failed)" if int(rc) == 1 else "NOT CAUGHT")
modules.read_source = original
modules.clear_cache()
PY
      note plant "$(grep -c 'CAUGHT (tests' "$OUT/plant.log") of 4 planted bugs caught" ;;
    launchers)
      python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_launchers.py -k "attention or window or rows or launch_order" \
        2>&1 | tee "$OUT/launchers.log" | tail -8
      note launchers "$(tail -1 "$OUT/launchers.log")" ;;
    bench)
      python3 benchmarks/bench_prefill_attention.py --variants default d64-one-cta stages2 2>&1 | tee "$OUT/bench.log" | tail -8
      python3 benchmarks/bench_prefill_attention.py --tokens 2048 --prefix 6144 --repeats 10 2>&1 | tee -a "$OUT/bench.log" | tail -6
      python3 benchmarks/bench_prefill_attention.py --tokens 1024 --decodes 256 --repeats 10 2>&1 | tee -a "$OUT/bench.log" | tail -6
      note bench "see $OUT/bench.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "==== summary ===="
printf '%s\n' "${STATUS[@]}"
grep -E "^ +(8b|1b) " "$OUT/bench.log" 2>/dev/null
