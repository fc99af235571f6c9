"""`offline-paged bench`: throughput of a workload through the engine (like `vllm bench throughput`).

Runs one engine per (KV layout, block size) pair given, on the same workload and KV memory budget,
and prints one row per run with ratios against the first. Exit code 2 for bad options.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any

import click

from offline_paged.cli.engine_options import engine_config, engine_options
from offline_paged.cli.errors import CouldNotStart
from offline_paged.core.host_cpus import HostCpus


def _length_range(ctx, param, value: str) -> tuple[int, int]:
    from offline_paged.benchmark.bench import parse_length_range

    try:
        return parse_length_range(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_BENCH_OVERRIDES = {
    "model": {"help": "HF model dir, hub id or .gguf file (not with --dummy-weights)."},
    "dtype": {"help": "Repeat to compare, e.g. --dtype float16 --dtype bfloat16 (default: auto: float32 on the "
                      "CPU; on CUDA the checkpoint's torch_dtype, bfloat16 or float16; float32 checkpoints and "
                      "dummy weights run in float16)."},
    "block_size": {"help": "Repeat to sweep, e.g. --block-size 8 --block-size 16 (default: 16)."},
    "max_num_batched_tokens": {"default": 8192},
    "max_model_len": {"help": "Default: the workload's longest prompt + max_tokens."},
    "kv_cache_memory": {"help": "KV pool bytes, e.g. 8GiB (same for every run)."},
    "seed": {"help": "Workload seed (and the engine's)."},
}


@click.command("bench")
@click.option("--dummy-weights", "dummy_preset", default=None, metavar="PRESET",
              help="Random weights of a shape preset: smollm2-135m, llama-3.2-1b, llama-3.1-8b, "
                   "qwen3-0.6b, qwen2.5-7b, llama-3.1-70b (TP), tiny.")
@click.option("--weights-seed", type=int, default=0, show_default=True)
@click.option("--workload", type=click.Choice(["random", "file"]), default="random", show_default=True)
@click.option("--input-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL job for --workload file.")
@click.option("--dataset", type=click.Choice(["nano-vllm", "sharegpt-like"]), default="nano-vllm", show_default=True,
              help="Lengths of --workload random: nano-vllm (uniform in --input-len / --output-len) or "
                   "sharegpt-like (log-normal with ShareGPT's mean prompt and output lengths, 161 / 338 "
                   "tokens, clipped to 4..2048; --input-len / --output-len are ignored).")
@click.option("--num-requests", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--input-len", default="100:1024", show_default=True, callback=_length_range,
              help="Prompt length range LOW:HIGH (uniform, inclusive) or one length.")
@click.option("--output-len", default="100:1024", show_default=True, callback=_length_range,
              help="Output length range (exact: ignore_eos).")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@engine_options(repeatable=("dtype", "block_size", "kv_cache_dtype", "quantization", "grammar_mask_processes"),
                overrides=_BENCH_OVERRIDES)
@click.option("--kv-layout", "kv_layouts", type=click.Choice(["paged", "contiguous"]), multiple=True,
              help="Repeat to compare (default: paged). contiguous reserves max_model_len per sequence.")
@click.option("--compare-single", is_flag=True,
              help="With --data-parallel-size N or --tensor-parallel-size N: first run the same "
                   "workload on one engine process (one GPU).")
@click.option("--structured", type=click.Choice(["json"]), default=None,
              help="Run the workload a second time with every request constrained by a JSON schema (structured "
                   "output) and report it against the plain run (compare out tok/s); then a third time "
                   "unconstrained, each request to the length its constrained output reached (plain@json "
                   "lengths: the like-for-like run, since a completed grammar ends its request early).")
@click.option("--repeat", type=click.IntRange(1, 20), default=1, show_default=True,
              help="Run every configuration this many times, interleaved (plain, json, plain, json, ...: a "
                   "drift of the machine hits both alike); labels get #1, #2, ... and the report adds medians.")
@click.option("--warmup/--no-warmup", default=True, show_default=True)
@click.option("--roofline/--no-roofline", default=True, show_default=True,
              help="Measure copy bandwidth and matmul rate and estimate the floor.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--json-steps", is_flag=True, help="With --json: include the per-step series.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="PNG of KV blocks held vs filled over time (needs matplotlib).")
def bench(**options: Any) -> None:
    """Measure generation throughput on a random or file workload."""
    _check_options(options)
    dtypes = options["dtype"] or ("auto",)
    options["dtype"] = dtypes[0]
    # Every --kv-cache-dtype runs on each backend, after each other in this process (the ratio in one call).
    options["kv_cache_dtypes"] = options["kv_cache_dtype"] or ("auto",)
    options["kv_cache_dtype"] = options["kv_cache_dtypes"][0]
    # Likewise every --quantization (none: 16-bit weights), e.g. --quantization none --quantization fp8.
    options["quantizations"] = options["quantization"] or (None,)
    options["quantization"] = options["quantizations"][0]
    # And every --grammar-mask-processes for the --structured run (e.g. 0 and 8: in-process and mask processes).
    options["grammar_mask_counts"] = options["grammar_mask_processes"] or (None,)
    options["grammar_mask_processes"] = options["grammar_mask_counts"][0]
    if options["data_parallel_size"] != 1:
        _bench_data_parallel(options)
        return
    from offline_paged.worker.backend import checkpoint_dtype, select_backend

    results, backends, requests = [], [], None
    tensor_parallel_size = options["tensor_parallel_size"]
    # A checkpoint is read once (dtype "auto" follows its config.json); dummy weights are drawn per
    # dtype, on the device, in that dtype. Under tensor parallel each rank loads its own shard.
    whole = tensor_parallel_size == 1
    checkpoint = None if options["dummy_preset"] or not whole else _load(options, None)
    for dtype in dtypes:  # one backend per dtype, run after each other
        source = getattr(checkpoint, "source", None) or options["model"]
        try:
            backend = select_backend(options["device"], dtype, checkpoint_dtype(source), f"{source}/config.json")
        except ValueError as exc:
            raise click.UsageError(f"--dtype {dtype}: {exc}") from None
        loaded = (checkpoint or _load(options, backend)) if whole else None
        if requests is None:
            vocab_size, tokenizer = ((loaded.config.vocab_size, loaded.tokenizer) if whole
                                     else _vocab_and_tokenizer(options))
            requests = _workload(options, vocab_size, tokenizer)
        tag = f" {backend.dtype.name}" if len(dtypes) > 1 else ""
        if whole:
            results += _run_all(options | {"dtype": dtype}, backend, loaded, requests, tag=tag)
        else:
            results += _bench_tensor_parallel(options | {"dtype": dtype}, backend, requests, tag)
        backends.append(backend)
        del loaded
    _emit(options, results, backends[0], "/".join(b.dtype.name for b in backends))


def _bench_tensor_parallel(options: dict, backend, requests, tag: str = "") -> list:
    """The workload at TP=1 first (with --compare-single), then at TP=N; each rank loads its own
    shard (dummy weights are drawn per shard on its GPU, so a 70B shape never exists whole)."""
    from offline_paged.benchmark.bench import release_device_memory
    from offline_paged.models.tp_source import CheckpointSource, DummySource

    results = []
    if options["compare_single"]:
        loaded = _load(options, backend)
        results += _run_all(options, backend, loaded, requests, tensor_parallel_size=1, tag=tag)
        del loaded
        release_device_memory(backend)
    size = options["tensor_parallel_size"]
    source = (DummySource(options["dummy_preset"], options["weights_seed"]) if options["dummy_preset"]
              else CheckpointSource(options["model"]))
    return results + _run_all(options, backend, source, requests, tensor_parallel_size=size, tag=tag)


def _check_options(options: dict) -> None:
    if options["model"] and options["dummy_preset"]:
        raise click.UsageError("give --model or --dummy-weights, not both")
    if len(options["dtype"]) > 1 and options["data_parallel_size"] != 1:
        raise click.UsageError("several --dtype values need --data-parallel-size 1 (one run per dtype)")
    if len(options["kv_cache_dtype"]) > 1 and options["data_parallel_size"] != 1:
        raise click.UsageError("several --kv-cache-dtype values need --data-parallel-size 1 (one run per value)")
    if len(options["quantization"]) > 1 and options["data_parallel_size"] != 1:
        raise click.UsageError("several --quantization values need --data-parallel-size 1 (one run per value)")
    if options["workload"] == "file" and not options["input_file"]:
        raise click.UsageError("--workload file needs --input-file JOB.jsonl")
    if options["workload"] == "random" and options["input_file"]:
        raise click.UsageError("--input-file is only read with --workload file")
    if options["tensor_parallel_size"] != 1 and options["data_parallel_size"] != 1:
        raise click.UsageError("--tensor-parallel-size and --data-parallel-size cannot be combined yet")
    if options["compare_single"] and options["data_parallel_size"] == 1 and options["tensor_parallel_size"] == 1:
        raise click.UsageError("--compare-single needs --data-parallel-size N or --tensor-parallel-size N "
                               "with N > 1")
    if options["data_parallel_size"] != 1 and (options["plot"] or options["json_steps"]):
        raise click.UsageError("--plot and --json-steps need per-step series, which data-parallel "
                               "runs do not record")
    if options["structured"] and (options["data_parallel_size"] != 1 or options["tensor_parallel_size"] != 1):
        raise click.UsageError("--structured runs on one engine (no --data-parallel-size / --tensor-parallel-size)")
    if options["json_steps"] and not options["as_json"]:
        raise click.UsageError("--json-steps needs --json")
    if options["plot"]:
        from offline_paged.benchmark.bench_report import matplotlib_available

        if not matplotlib_available():
            raise click.UsageError("--plot needs matplotlib, which is not installed "
                                   "(pip install 'offline-paged[plot]')")
    if options["dummy_preset"]:
        from offline_paged.models.dummy_weights import PRESETS

        if options["dummy_preset"] not in PRESETS:
            raise click.BadParameter(f"{options['dummy_preset']!r}; choose from {', '.join(PRESETS)}",
                                     param_hint="--dummy-weights")


def _load(options: dict, backend):
    if options["dummy_preset"]:
        from offline_paged.models.dummy_weights import dummy_model

        return dummy_model(options["dummy_preset"], backend.xp, backend.dtype, options["weights_seed"])
    from offline_paged.models.loader import load_model

    try:
        return load_model(options["model"])
    except (ValueError, OSError) as exc:
        raise CouldNotStart(f"cannot load the model: {exc}") from None


def _run_all(options: dict, backend, loaded, requests, tensor_parallel_size: int = 1, tag: str = "") -> list:
    """Every (layout, block size) run of one backend and model; `tag` is appended to each label."""
    from offline_paged.benchmark.bench import (at_lengths, max_total_len, measure_ceilings, release_device_memory,
                                               run_bench, structured_workload, warm_up, warm_up_grammars)
    from offline_paged.engine import LLMEngine

    ceilings = measure_ceilings(backend) if options["roofline"] else None
    max_model_len = options["max_model_len"] or max_total_len(requests)
    layouts = options["kv_layouts"] or ("paged",)
    block_sizes = options["block_size"] or (16,)
    kv_dtypes = options.get("kv_cache_dtypes") or (options["kv_cache_dtype"],)
    quantizations = options.get("quantizations") or (options["quantization"],)
    results = []
    variants = [("", requests, None)]  # (label, requests, grammar_mask_processes)
    constrained = None
    if options.get("structured"):
        constrained = structured_workload(requests, options["structured"])
        counts = options.get("grammar_mask_counts") or (options["grammar_mask_processes"],)
        variants += [(f" {options['structured']}" + ("" if len(counts) == 1 else f" m={count}"), constrained, count)
                     for count in counts]
        # Unconstrained again, each request to the length its first constrained run of this repeat reached:
        # the like-for-like comparison (requests whose grammar completed ended early; the plain run's did not).
        variants.append((f" plain@{options['structured']} lengths", None, None))
    repeats = options.get("repeat") or 1
    lengths = None  # output lengths of this repeat's first constrained run
    for layout, block_size, quantization, kv_dtype, repeat, (variant, run_requests, mask_count) in itertools.product(
            layouts, block_sizes, quantizations, kv_dtypes, range(repeats), variants):
        if not variant:
            lengths = None
        elif run_requests is None:
            run_requests = at_lengths(requests, lengths)
        # one fresh engine per run: a second run on the same engine would hit the prefix cache
        try:
            config = _engine_config(options | {"kv_cache_dtype": kv_dtype, "quantization": quantization,
                                               "grammar_mask_processes": mask_count},
                                    backend.name, layout, block_size, max_model_len, tensor_parallel_size)
            started = time.perf_counter()
            engine = LLMEngine(config, loaded_model=loaded)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        except RuntimeError as exc:  # a tensor-parallel rank failed to start
            raise CouldNotStart(str(exc)) from None
        if options["warmup"]:
            warm_up(engine, loaded.config.vocab_size)
        if any(r.params.structured_outputs is not None for r in run_requests):
            try:
                warm_up_grammars(engine, run_requests)  # compiled outside the timing (also without --warmup)
            except ValueError as exc:
                where = "--structured" if run_requests is constrained else f"--input-file {options['input_file']}"
                raise click.UsageError(f"{where}: {exc}") from None
        label = layout if len(block_sizes) == 1 else f"{layout} B={block_size}"
        if options["tensor_parallel_size"] != 1:
            label += f" TP={tensor_parallel_size}"
        if len(kv_dtypes) > 1 or engine.kv_cache_dtype != "auto":
            label += f" kv={engine.kv_cache_dtype}"
        if config.quantization or len(quantizations) > 1:
            label += f" w={config.quantization or 'none'}"
        label += tag + variant + (f" #{repeat + 1}" if repeats > 1 else "")
        print(f"running {label} ...", file=sys.stderr, flush=True)
        start_s = time.perf_counter() - started  # (the grammars' compile counts too: a job pays it before its lines)
        results.append(run_bench(engine, run_requests, label=label, kv_layout=layout, ceilings=ceilings))
        results[-1].engine_start_s = start_s
        if variant and run_requests is constrained and lengths is None:
            lengths = results[-1].output_lengths
        engine.close()
        del engine
        release_device_memory(backend)
    return results


def _bench_data_parallel(options: dict) -> None:
    """The workload through N worker processes (and first through one when --compare-single); the
    model is loaded only in the workers, the tokenizer and config here for the workload."""
    from offline_paged.dp.dp_coordinator import worker_devices

    try:
        device, _ = worker_devices(options["device"], options["data_parallel_size"])
    except ValueError as exc:
        raise click.UsageError(f"--data-parallel-size: {exc}") from None
    vocab_size, tokenizer = _vocab_and_tokenizer(options)
    requests = _workload(options, vocab_size, tokenizer)
    sizes = ([1] if options["compare_single"] else []) + [options["data_parallel_size"]]
    results = []
    for layout in options["kv_layouts"] or ("paged",):
        for block_size in options["block_size"] or (16,):
            for size in sizes:
                results.append(_run_data_parallel(options, device, tokenizer, requests, layout,
                                                  block_size, size))
    _emit(options, results, _NamedBackend(device, options["dtype"], options["model"]))


def _run_data_parallel(options: dict, device: str, tokenizer, requests, layout: str, block_size: int,
                       size: int):
    from offline_paged.benchmark.bench import max_total_len
    from offline_paged.benchmark.dp_bench import run_data_parallel_bench
    from offline_paged.dp.dp_coordinator import DataParallelCoordinator
    from offline_paged.dp.dp_worker import WorkerSpec

    try:
        spec = WorkerSpec(_engine_config(options, device, layout, block_size,
                                         options["max_model_len"] or max_total_len(requests)),
                          options["dummy_preset"], options["weights_seed"], warm_up=options["warmup"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    label = (f"{size} engine" + ("s" if size > 1 else "")) + ("" if len(options["block_size"] or (16,)) == 1
                                                            else f" {layout} B={block_size}")
    print(f"starting {size} engine process(es) for {label} ...", file=sys.stderr, flush=True)
    try:
        with DataParallelCoordinator(spec, size, tokenizer=tokenizer) as coordinator:
            print(f"running {label} ...", file=sys.stderr, flush=True)
            return run_data_parallel_bench(coordinator, requests, label=label, kv_layout=layout,
                                           block_size=block_size)
    except RuntimeError as exc:
        raise CouldNotStart(str(exc)) from None


def _engine_config(options: dict, device: str, layout: str, block_size: int, max_model_len: int,
                   tensor_parallel_size: int = 1):
    return engine_config(options, device=device, block_size=block_size, max_model_len=max_model_len,
                         kv_layout=layout, tensor_parallel_size=tensor_parallel_size,
                         async_scheduling=options["async_scheduling"] if tensor_parallel_size == 1 else False)


def _graphs_label(options: dict, backend) -> str:
    """The header's words on CUDA graphs (CUDA only): off, or how large a prefilling step replays them."""
    if backend.name != "cuda":
        return ""
    if not options["cuda_graphs"]:
        return ", CUDA graphs off"
    tokens = min(options["mixed_graph_tokens"], options["max_num_batched_tokens"])
    return f", mixed-step graphs up to {tokens} tokens" if tokens else ", mixed-step graphs off"


def _vocab_and_tokenizer(options: dict):
    if options["dummy_preset"]:
        from offline_paged.models.dummy_weights import DummyTokenizer, preset_config

        config = preset_config(options["dummy_preset"])
        return config.vocab_size, DummyTokenizer(config.eos_token_ids)
    from offline_paged.models.loader import load_tokenizer

    try:
        config, tokenizer = load_tokenizer(options["model"])
    except (ValueError, OSError) as exc:
        raise CouldNotStart(f"cannot load the model: {exc}") from None
    return config.vocab_size, tokenizer


def _workload(options: dict, vocab_size: int, tokenizer):
    from offline_paged.benchmark.bench import file_workload, random_workload, sharegpt_like_workload

    if options["workload"] == "random" and options["dataset"] == "sharegpt-like":
        return sharegpt_like_workload(options["num_requests"], vocab_size, options["seed"], options["temperature"])
    if options["workload"] == "random":
        return random_workload(options["num_requests"], options["input_len"], options["output_len"],
                               vocab_size, options["seed"], options["temperature"])
    try:
        return file_workload(options["input_file"], tokenizer)
    except (ValueError, OSError) as exc:
        raise click.UsageError(str(exc)) from None


class _NamedBackend:
    """What the report needs to know of a backend the coordinator never built (no CUDA here)."""

    def __init__(self, device: str, dtype: str | None, model: str | None = None) -> None:
        from types import SimpleNamespace

        self.name = device
        if device in ("cpu", "cuda"):
            from offline_paged.worker.backend import checkpoint_dtype, resolve_dtype

            dtype = resolve_dtype(device, dtype, checkpoint_dtype(model))
        self.dtype = SimpleNamespace(name=dtype or "auto")
        self.xp = None


def _emit(options: dict, results: list, backend, dtype_names: str | None = None) -> None:
    from offline_paged.benchmark.bench_report import format_report, plot_kv

    source = options["dummy_preset"] and f"dummy weights {options['dummy_preset']}" or options["model"] or "default model"
    if options["data_parallel_size"] != 1:
        source += f", data parallel {options['data_parallel_size']}"
    if options["tensor_parallel_size"] != 1:
        source += f", tensor parallel {options['tensor_parallel_size']}"
    kv_dtypes = sorted({getattr(r, "kv_cache_dtype", "auto") for r in results}) or ["auto"]
    quantizations = options.get("quantizations") or (options.get("quantization"),)
    quantization = "/".join(q or "none" for q in quantizations) if len(quantizations) > 1 else quantizations[0]
    header = (f"offline-paged bench: {source}, {backend.name} {dtype_names or backend.dtype.name}, kv cache "
              f"{'/'.join(kv_dtypes)}, quantization {quantization or 'none'}, workload {options['workload']}"
              + _workload_label(options) + _graphs_label(options, backend))
    if options["as_json"]:
        runs = [json.loads(r.to_json(with_steps=options["json_steps"])) for r in results]
        click.echo(json.dumps({"header": header, "git_commit": _git_commit(), "device": _device_name(backend),
                               "host": HostCpus.read().record(), "kv_cache_dtype": "/".join(kv_dtypes),
                               "quantization": quantization, "runs": runs}))
    else:
        click.echo(format_report(results, header))
    if options["plot"]:
        plot_kv(results, options["plot"])
        click.echo(f"plot written to {options['plot']}", err=True)


def _workload_label(options: dict) -> str:
    """" N=256 in=100:1024 out=100:1024" or " sharegpt-like N=4096" for random workloads; "" for a file."""
    if options["workload"] != "random":
        return ""
    if options["dataset"] == "sharegpt-like":
        return f" sharegpt-like N={options['num_requests']}"
    return f" N={options['num_requests']} in={_span(options['input_len'])} out={_span(options['output_len'])}"


def _span(bounds: tuple[int, int]) -> str:
    return f"{bounds[0]}:{bounds[1]}"


def _git_commit() -> str | None:
    """$OFFLINE_PAGED_GIT_COMMIT when set (a copied tree), else the checkout's commit (with "+dirty"
    when it has changes), else None."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("OFFLINE_PAGED_GIT_COMMIT"):  # a copied tree whose .git may be stale
        return os.environ["OFFLINE_PAGED_GIT_COMMIT"]

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("OFFLINE_PAGED_GIT_COMMIT")
    return commit + ("+dirty" if dirty else "")


def _device_name(backend) -> str:
    if backend.name == "cuda" and backend.xp is None:  # data parallel: no CUDA in this process
        return _nvidia_smi_name()
    if backend.name != "cuda":
        import platform

        return f"cpu {platform.processor() or platform.machine()}"
    props = backend.xp.cuda.runtime.getDeviceProperties(backend.xp.cuda.Device().id)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def _nvidia_smi_name() -> str:
    import subprocess

    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "cuda"
    names = [n.strip() for n in names if n.strip()]
    return f"{len(names)} x {names[0]}" if names else "cuda"
