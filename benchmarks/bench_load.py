"""Weight-load speed and peak host memory: an 8B-shaped bf16 checkpoint, loaded from the page cache.

Prints figures; asserts nothing (tests assert behaviour, benchmarks measure).
Run: .venv/bin/python benchmarks/bench_load.py DIR [--scale 1.0] [--device auto|cpu|cuda]
     [--dtype bfloat16|float16|float32] [--repeats 2]

The first call writes a Llama-3.1-8B-shaped checkpoint (hidden 4096, 32 layers, intermediate 14336,
vocab 128256, 8 KV heads, untied; about 16 GB at --scale 1) of random bf16 values in 4 shards with an
index to DIR; later calls reuse it (delete DIR to rewrite). --scale shrinks hidden, intermediate and
vocab by that factor (bytes ~ scale^2) for a smoke run. Each load is timed with the files in the page
cache (the write, or the previous load, put them there); the last one is the figure. Peak host RSS
is the process's VmHWM, reset before each load (/proc/self/clear_refs), minus its RSS just before.
On CUDA the staged path (file -> pinned ring -> device) is compared with the pageable one
(memory-mapped view -> cupy.asarray per tensor) in the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import time
from pathlib import Path

import numpy as np

from offline_paged.models.checkpoint import open_checkpoint
from offline_paged.models.config import LlamaConfig
from offline_paged.models.loader import read_weights
from offline_paged.models.weight_upload import BFLOAT16, to_device
from offline_paged.models.weight_spec import expected_weight_shapes

NUM_SHARDS = 4
GIB = 1 << 30


def llama8b_config(scale: float) -> LlamaConfig:
    def scaled(n: int, multiple: int) -> int:
        return max(multiple, round(n * scale / multiple) * multiple)

    return LlamaConfig(vocab_size=scaled(128256, 64), hidden_size=scaled(4096, 128),
                       intermediate_size=scaled(14336, 128), num_hidden_layers=32,
                       num_attention_heads=scaled(4096, 128) // 128, num_key_value_heads=min(8, scaled(4096, 128) // 128),
                       head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=False)


def write_checkpoint(directory: Path, config: LlamaConfig, seed: int = 0) -> None:
    """config.json, 4 shards of random bf16 balanced by bytes, model.safetensors.index.json."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = expected_weight_shapes(config)
    total = sum(2 * math.prod(s) for s in shapes.values())
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(32 << 20, dtype=np.float32) * 0.02).astype(BFLOAT16)  # [32 Mi] 64 MB
    shards: list[list[str]] = [[] for _ in range(NUM_SHARDS)]
    written = 0
    for name, shape in shapes.items():
        shards[min(NUM_SHARDS - 1, written * NUM_SHARDS // total)].append(name)
        written += 2 * math.prod(shape)
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        _write_shard(directory / file, {n: shapes[n] for n in names}, pool, rng)
        weight_map |= dict.fromkeys(names, file)
        print(f"  wrote {file} ({(directory / file).stat().st_size / GIB:.2f} GiB)", flush=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config.to_dict() | {"torch_dtype": "bfloat16"}, indent=2))


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], pool: np.ndarray, rng) -> None:
    header, begin = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [begin, begin + 2 * math.prod(shape)]}
        begin += 2 * math.prod(shape)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for shape in shapes.values():
            left = math.prod(shape)
            while left:  # windows of the random pool at random offsets
                count = min(left, pool.size // 2)
                start = int(rng.integers(0, pool.size - count + 1))
                f.write(pool[start:start + count].tobytes())
                left -= count


def _status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def timed_load(directory: Path, config: LlamaConfig, xp, dtype, path: str) -> tuple[float, int, int]:
    """(seconds, bytes read, peak RSS above the RSS before the load) of one load to `xp`."""
    _reset_peak_rss()
    baseline = _status_bytes("VmRSS")
    began = time.perf_counter()
    if path == "pageable":  # the plain per-tensor route, for comparison with the staged one
        checkpoint = open_checkpoint(directory)
        weights = {name: to_device(checkpoint[name], xp, dtype) for name in expected_weight_shapes(config)}
    else:
        weights = read_weights(directory, config, xp, dtype, progress=False)
    if xp is not np:
        xp.cuda.Device().synchronize()
    seconds = time.perf_counter() - began
    peak = _status_bytes("VmHWM") - baseline
    num_bytes = open_checkpoint(directory).nbytes(weights)
    del weights
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    return seconds, num_bytes, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = llama8b_config(args.scale)
    if not (args.directory / "model.safetensors.index.json").is_file():
        print(f"writing an 8B-shaped bf16 checkpoint (scale {args.scale}) to {args.directory}", flush=True)
        write_checkpoint(args.directory, config)
    else:
        config = LlamaConfig.from_file(args.directory / "config.json")
    xp = np
    if args.device in ("auto", "cuda"):
        try:
            import cupy as xp  # noqa: F811
        except ImportError:
            if args.device == "cuda":
                raise
    dtype = BFLOAT16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    checkpoint = open_checkpoint(args.directory)
    print(f"checkpoint {checkpoint.nbytes() / GIB:.2f} GiB in {len(checkpoint.shards)} shards, largest "
          f"{checkpoint.largest_shard_bytes() / GIB:.2f} GiB; device {xp.__name__}, dtype {args.dtype}")
    for path in (["staged", "pageable"] if xp is not np else ["numpy"]):
        for k in range(args.repeats):
            seconds, num_bytes, peak = timed_load(args.directory, config, xp, dtype, path)
            print(f"  {path:8s} load {k + 1}: {seconds:6.2f} s  {num_bytes / seconds / 1e9:6.2f} GB/s  "
                  f"peak host RSS +{peak / GIB:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
