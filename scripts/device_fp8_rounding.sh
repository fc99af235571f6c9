#!/usr/bin/env bash
# The hardware e4m3 rounding (cuda/fp8.cuh FP8_HARDWARE_ROUNDING) on the device: the GPU tests of every vector FP8
# write (fused linear inputs, KV writes, the FP8-weight engine), then the 8B FP8 weights + KV bench with it on and off
# (a device-side edit, undone after). Usage: OUT=/tmp/out OFFLINE_PAGED_GIT_COMMIT=... bash scripts/device_fp8_rounding.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_cuda_fp8_fused.py tests/test_ops_cuda_fp8.py -k "not every_attention_kernel and not sliding_window" tests/test_gpu_engine_fp8_weights.py > $OUT/tests.log 2>&1; echo "gpu tests: $(tail -1 $OUT/tests.log)"; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
H=cuda/fp8.cuh; cp $H /tmp/h.orig
for hw in 1 0; do sed -i "s/^#define FP8_HARDWARE_ROUNDING .*/#define FP8_HARDWARE_ROUNDING $hw/" $H
PYTHONFAULTHANDLER=1 timeout 110 offline-paged bench --device cuda --json --cuda-graphs --no-roofline --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 --dummy-weights llama-3.1-8b > $OUT/bench_hw$hw.json 2>$OUT/bench_hw$hw.err || { echo "bench hw=$hw FAILED"; tail -3 $OUT/bench_hw$hw.err; }
cp /tmp/h.orig $H; done
for hw in 1 0; do python3 -c "
import json
r=json.loads(open('$OUT/bench_hw$hw.json').read().strip().splitlines()[-1])['runs'][0]
print('hw rounding $hw', f\"{r['output_tokens_per_s']:,.0f} out tok/s, forward {r['time_split']['forward_device_ms']:.2f} ms\")"; done
