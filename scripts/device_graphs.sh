#!/usr/bin/env bash
# CUDA graphs for decode steps on the lent device machine, in one call:
#   A (in parallel, correctness only): tests/test_graphs.py, test_step_inputs_launcher.py and
#     test_cuda_graph_runner.py (GEMM vs cupy.matmul eagerly and
#     replayed; graph decode vs eager across buckets with padding rows; engine with vs without graphs)
#     and tests/test_gpu_engine.py with the graph path forced on in every engine;
#   B: the bench on the 1B shape, graphs off then on (same process kind, same workload);
#   C: eager vs graph-replayed decode step time on the 1B shape at 64 and 256 sequences.
# Usage: OUT=/tmp/out scripts/device_graphs.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/graphs-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }

DRIVER=/tmp/graphs_driver.py
cat >"$DRIVER" <<'PY'
"""GRAPHS=1 forces cuda_graphs=True in every engine (GRAPHS=0 forces it off), then runs pytest or the bench."""
import os, sys, time
import numpy as np
import offline_paged.engine as engine_module

class _Runner(engine_module.ModelRunner):
    def __init__(self, *args, **kwargs):
        kwargs["cuda_graphs"] = os.environ["GRAPHS"] == "1"
        super().__init__(*args, **kwargs)

if "GRAPHS" in os.environ:
    engine_module.ModelRunner = _Runner
mode, args = sys.argv[1], sys.argv[2:]
if mode == "pytest":
    import pytest
    sys.exit(pytest.main(args))
if mode == "bench":
    from offline_paged.cli.main import cli
    cli(["bench", *args], standalone_mode=True)
if mode == "decode":
    import cupy
    from offline_paged.ops.ops_cuda import CudaOps
    from offline_paged.worker.cuda_graph_runner import DecodeGraphs
    from offline_paged.ops.attention import AttentionMetadata
    from offline_paged.models.dummy_weights import dummy_model
    from offline_paged.models.llama import Llama
    loaded = dummy_model("llama-3.2-1b", cupy, np.float16, 0)
    model = Llama(loaded.config, loaded.weights, CudaOps(), np.float16)
    ctx, B = 512, 16
    kv = model.allocate_kv_cache(256 * ctx // B, B)
    graphs = DecodeGraphs(model, kv, B, max_model_len=2048)
    for S in (64, 256):
        tables = [list(range(i * ctx // B, (i + 1) * ctx // B)) for i in range(S)]
        pos = np.full(S, ctx - 1); slots = np.array([t[-1] * B + B - 1 for t in tables]); ids = np.arange(S)
        i32 = lambda a: cupy.asarray(np.asarray(a), dtype=cupy.int32)
        def eager():
            meta = AttentionMetadata(slot_mapping=i32(slots), block_tables=i32(tables), context_lens=i32(pos + 1),
                                     query_start_loc=i32(np.arange(S + 1)), max_query_len=1, max_context_len=ctx)
            return model.forward(i32(ids), i32(pos), kv, meta, i32(np.arange(S)))
        replay = lambda: graphs.run(ids, pos, slots, tables)
        for name, fn in (("eager", eager), ("graph", replay)):
            for _ in range(3): fn()
            cupy.cuda.Device().synchronize()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(10): fn()
                cupy.cuda.Device().synchronize()
                times.append((time.perf_counter() - t0) / 10)
            print(f"decode S={S} ctx={ctx} {name}: {1e3 * np.median(times):.2f} ms/step (median of 5x10, min {1e3 * min(times):.2f})")
PY

T="-q -p no:cacheprovider -m gpu"
(timeout 75 python3 "$DRIVER" pytest $T tests/test_graphs.py tests/test_step_inputs_launcher.py tests/test_cuda_graph_runner.py >"$OUT/graphs_tests.log" 2>&1; echo "rc $?" >>"$OUT/graphs_tests.log") &
(GRAPHS=1 timeout 75 python3 "$DRIVER" pytest $T tests/test_gpu_engine.py >"$OUT/gpu_engine_graphs.log" 2>&1; echo "rc $?" >>"$OUT/gpu_engine_graphs.log") &
wait
for f in graphs_tests gpu_engine_graphs; do
  echo "== $f: $(grep -E 'passed|failed|error' "$OUT/$f.log" | tail -1) $(tail -1 "$OUT/$f.log")"
  grep -E "^(FAILED|ERROR)|Error:" "$OUT/$f.log" | head -8
done

for g in 0 1; do
  GRAPHS=$g timeout 45 python3 "$DRIVER" bench --dummy-weights llama-3.2-1b --device cuda --num-requests 256 \
    >"$OUT/bench_graphs$g.txt" 2>&1
  echo "== bench graphs=$g (rc $?)"; tail -22 "$OUT/bench_graphs$g.txt"
done

timeout 25 python3 "$DRIVER" decode 2>&1 | tee "$OUT/decode.txt" | grep -E "decode|Error"
