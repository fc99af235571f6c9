"""The engine options of `generate`, `bench` and `eval`, declared once.

Every option's click destination is the EngineConfig field (or `LLM(...)` argument) of the same name:
a command builds its EngineConfig with `engine_config(options)`, and `eval` forwards the options given
on its command line as lm-eval model_args, which reach `LLM(...)` under the same names. A command may
change an option's default or help (bench: a larger token budget) or make it repeatable (bench sweeps
--dtype and --block-size), never its flags, type or validation: a bad value gets the same message from
every command.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import click
from click.core import ParameterSource

from offline_paged.core.config import (DEVICES, DTYPE_ALIASES, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig,
                                       PreemptionMode)

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}
_OVERRIDABLE = frozenset({"default", "help"})


def parse_size(text: str) -> int:
    """"4GiB", "512MiB", "1000000" -> bytes (more than 0); click.BadParameter otherwise."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgib")
    unit = cleaned[len(number):]
    try:
        if unit not in _SIZE_UNITS:
            raise ValueError
        size = int(float(number) * _SIZE_UNITS[unit])
    except (ValueError, OverflowError):
        raise click.BadParameter(f"{text!r} is not a size like 2GiB, 512MiB or 1000000") from None
    if size <= 0:
        raise click.BadParameter(f"{text!r} is not more than 0 bytes")
    return size


class ByteSize(click.ParamType):
    """A size with an optional unit (2GiB, 512MiB, 1000000) -> bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(str(value))
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


def _canonical_quantization(ctx: click.Context, param: click.Parameter, value):
    """"none" -> None (EngineConfig's value for 16-bit weights), so a repeated bench option can name both."""
    if isinstance(value, tuple):
        return tuple(None if v == "none" else v for v in value)
    return None if value == "none" else value


def _canonical_dtype(ctx: click.Context, param: click.Parameter, value: str | tuple[str, ...]):
    """vLLM's spellings "half" / "float" -> float16 / float32, so every command sees one name."""
    if isinstance(value, tuple):
        return tuple(DTYPE_ALIASES.get(v, v) for v in value)
    return DTYPE_ALIASES.get(value, value)


@dataclass(frozen=True, slots=True)
class EngineOption:
    """One engine option: `name` is its click destination, the EngineConfig field or LLM argument it sets."""

    name: str
    decls: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    def decorator(self, override: dict[str, Any], repeatable: bool) -> Callable:
        unknown = set(override) - _OVERRIDABLE
        if unknown:
            raise ValueError(f"engine option {self.name}: only {sorted(_OVERRIDABLE)} may change per command, "
                             f"not {sorted(unknown)}")
        attrs = self.attrs | override
        if repeatable:
            attrs |= {"multiple": True, "default": (), "show_default": False}
        return click.option(*self.decls, self.name, **attrs)


def _option(name: str, *decls: str, **attrs: Any) -> EngineOption:
    return EngineOption(name, decls, attrs)


_POSITIVE = click.IntRange(min=1)
ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    _option("model", "-m", "--model", default=None,
            help="HF model dir, hub id (ORG/NAME, from the HF cache or downloaded), .gguf file, or 'default' "
                 "(SmolLM2-135M-Instruct)."),
    _option("device", "--device", type=click.Choice(DEVICES), default="auto", show_default=True),
    _option("dtype", "--dtype", type=click.Choice([*DTYPES, *DTYPE_ALIASES]), default="auto", show_default=True,
            callback=_canonical_dtype,
            help="auto: float32 on the CPU; on CUDA the checkpoint's torch_dtype (bfloat16 or float16; float32 "
                 "checkpoints run in float16). half / float are vLLM's names of float16 / float32."),
    _option("max_num_seqs", "--max-num-seqs", type=_POSITIVE, default=None,
            help="Sequences in one step at most (default: 1024 on a GPU of 70 GiB or more, 512 there if the KV "
                 "cache then holds fewer than 512 tokens a sequence; else 256)."),
    _option("max_num_batched_tokens", "--max-num-batched-tokens", type=_POSITIVE, default=None,
            help="Tokens in one step at most (longer prompts are prefilled in chunks; default: 8192 on CUDA, "
                 "2048 on the CPU)."),
    _option("max_model_len", "--max-model-len", type=click.IntRange(min=2), default=None,
            help="Longest prompt + output (default: the model's context length, capped by the KV pool)."),
    _option("block_size", "--block-size", type=_POSITIVE, default=16, show_default=True,
            help="Tokens per KV block."),
    _option("num_kv_blocks", "--num-kv-blocks", type=_POSITIVE, default=None,
            help="KV pool size in blocks (wins over memory)."),
    _option("kv_cache_memory", "--kv-cache-memory", type=ByteSize(), default=None, metavar="SIZE",
            help="KV pool size in bytes, e.g. 2GiB."),
    _option("kv_cache_dtype", "--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
            show_default=True,
            help="auto: K/V in the model dtype; fp8 / fp8_e4m3: FP8 e4m3 (1 byte an element, twice the blocks "
                 "of a 16-bit pool)."),
    _option("calculate_kv_scales", "--calculate-kv-scales/--no-calculate-kv-scales", default=False,
            show_default=True,
            help="FP8 KV cache: per-layer K and V scales from the first prefill instead of 1.0."),
    _option("quantization", "--quantization", type=click.Choice(("none", *QUANTIZATIONS)), default=None,
            callback=_canonical_quantization,
            help="fp8: the layers' linear weights in FP8 e4m3 (per-output-channel scales, activations quantized "
                 "per token; on CUDA through cuBLASLt's FP8 GEMM, Hopper or newer); none: 16-bit (the default). "
                 "A pre-quantized FP8 checkpoint needs no flag."),
    _option("gpu_memory_utilization", "--gpu-memory-utilization",
            type=click.FloatRange(min=0, max=1, min_open=True), default=0.9, show_default=True,
            help="Fraction of free GPU memory the weights' leftovers may give the KV cache."),
    _option("preemption_mode", "--preemption", type=click.Choice([m.value for m in PreemptionMode]),
            default="recompute", show_default=True,
            help="What a preempted sequence's KV becomes: dropped and recomputed, or swapped to the CPU."),
    _option("enable_prefix_caching", "--prefix-caching/--no-prefix-caching", default=True, show_default=True,
            help="Reuse the KV blocks of prompt prefixes computed before."),
    _option("cuda_graphs", "--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
            help="Replay decode-only steps from CUDA graphs (CUDA)."),
    _option("mixed_graph_tokens", "--mixed-graph-tokens", type=click.IntRange(min=0), default=2048,
            show_default=True, help="With CUDA graphs: steps that prefill, of up to this many tokens, replay "
            "piecewise graphs (attention runs between the pieces); 0 runs them eagerly."),
    _option("async_scheduling", "--async-scheduling/--sync-scheduling", default=None,
            help="Overlap scheduling with the device step (default: on for CUDA, off on the CPU)."),
    _option("admission_batch", "--admission-batch", type=_POSITIVE, default=None,
            help="While every running sequence decodes, admit waiting ones only once this many fit "
                 "(default: max-num-seqs // 8 on CUDA, 1 on the CPU; 1 = whenever one fits)."),
    _option("grammar_mask_processes", "--grammar-mask-processes", type=click.IntRange(min=0), default=None,
            help="Structured output: processes that fill the grammar masks beside the device step, with async "
                 "scheduling (default: min(8, physical cores // 2) on CUDA, 0 on the CPU; 0: this process fills "
                 "them)."),
    _option("seed", "--seed", type=click.IntRange(min=0), default=0, show_default=True,
            help="Engine seed (for unseeded requests)."),
    _option("max_logprobs", "--max-logprobs", type=click.IntRange(min=0), default=20, show_default=True,
            help="Most logprobs / prompt_logprobs a request may ask for."),
    _option("data_parallel_size", "--data-parallel-size", type=_POSITIVE, default=1, show_default=True,
            help="Engine processes, one per GPU (on the CPU: processes too); requests are dealt to them "
                 "dynamically."),
    _option("tensor_parallel_size", "--tensor-parallel-size", type=_POSITIVE, default=1, show_default=True,
            help="Shard the model over N GPUs (one process each, NCCL; on the CPU: processes over pipes); "
                 "N must divide the attention heads, KV heads and intermediate size."),
)
ENGINE_OPTION_NAMES = tuple(option.name for option in ENGINE_OPTIONS)
_CONFIG_FIELDS = frozenset(f.name for f in fields(EngineConfig))


def engine_options(*, exclude: tuple[str, ...] = (), overrides: dict[str, dict[str, Any]] | None = None,
                   repeatable: tuple[str, ...] = ()) -> Callable:
    """A decorator that adds the engine options (less `exclude`) to a click command, in declaration order.
    `overrides` changes an option's default or help; `repeatable` options take several values (a tuple)."""
    overrides = overrides or {}
    named = set(exclude) | set(overrides) | set(repeatable)
    if not named <= set(ENGINE_OPTION_NAMES):
        raise ValueError(f"not engine options: {sorted(named - set(ENGINE_OPTION_NAMES))}")
    chosen = [o for o in ENGINE_OPTIONS if o.name not in exclude]

    def decorate(command: Callable) -> Callable:
        for option in reversed(chosen):  # click lists the last-applied option first
            command = option.decorator(overrides.get(option.name, {}), option.name in repeatable)(command)
        return command

    return decorate


def engine_config(options: dict[str, Any], **overrides: Any) -> EngineConfig:
    """EngineConfig from a command's parsed options (the engine options among them) and `overrides`;
    a value EngineConfig refuses is a click.UsageError (exit 2) with its message."""
    values = {name: options[name] for name in ENGINE_OPTION_NAMES if name in _CONFIG_FIELDS and name in options}
    try:
        return EngineConfig(**(values | overrides))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def given_engine_options(ctx: click.Context) -> dict[str, Any]:
    """The engine options given on the command line (or the environment), not left at their defaults;
    in declaration order."""
    return {name: ctx.params[name] for name in ENGINE_OPTION_NAMES
            if name in ctx.params
            and ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
