"""cli/engine_options.py: generate, bench and eval take the same engine options with the same validation,
and the parsed options build the EngineConfig under the names LLM(...) takes."""
from __future__ import annotations

import inspect
from dataclasses import fields

import click
import pytest
from click.testing import CliRunner

from offline_paged.cli.engine_options import (ENGINE_OPTION_NAMES, engine_config, engine_options,
                                              given_engine_options, parse_size)
from offline_paged.cli.main import cli
from offline_paged.core.config import EngineConfig
from offline_paged.entrypoints.llm import LLM

LM_EVAL_OWN = {"model", "device", "seed"}  # lm-eval's run has these flags itself
BENCH_REPEATABLE = {"dtype", "block_size", "kv_cache_dtype", "quantization", "grammar_mask_processes"}  # bench sweeps them
# the command line each command needs besides the option under test
COMMANDS = {"generate": ["generate", "in.jsonl"], "bench": ["bench"], "eval": ["eval"]}


def _engine_params(name: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in cli.commands[name].params if p.name in ENGINE_OPTION_NAMES}


def _validation(param: click.Parameter) -> dict:
    """What decides which values an option takes: its flags and its type, not its default or help."""
    info = param.to_info_dict()
    return {key: info[key] for key in ("opts", "secondary_opts", "type", "is_flag", "nargs")} | {
        "callback": param.callback}


def test_the_three_commands_take_the_same_engine_options():
    generate, bench, eval_ = (_engine_params(name) for name in COMMANDS)
    assert set(generate) == set(bench) == set(ENGINE_OPTION_NAMES)
    assert set(eval_) == set(ENGINE_OPTION_NAMES) - LM_EVAL_OWN
    for name in ENGINE_OPTION_NAMES:
        assert _validation(bench[name]) == _validation(generate[name]), name
        assert bench[name].multiple == (name in BENCH_REPEATABLE) and not generate[name].multiple, name
        if name in eval_:
            assert _validation(eval_[name]) == _validation(generate[name]), name


@pytest.mark.parametrize("flag, value", [
    ("--num-kv-blocks", "0"), ("--kv-cache-memory", "lots"), ("--kv-cache-memory", "0"),
    ("--kv-cache-memory", "-1GiB"), ("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "0"),
    ("--dtype", "int8"), ("--max-num-seqs", "-1"), ("--max-num-batched-tokens", "0"), ("--max-model-len", "1"),
    ("--block-size", "0"), ("--tensor-parallel-size", "0"), ("--data-parallel-size", "0"),
    ("--admission-batch", "0"), ("--preemption", "drop"), ("--max-logprobs", "-1"), ("--max-num-seqs", "many"),
    ("--kv-cache-dtype", "int8"), ("--quantization", "int8"),
])
def test_a_bad_value_gets_the_same_message_from_every_command(flag, value):
    errors = {}
    for name, command in COMMANDS.items():
        result = CliRunner().invoke(cli, [*command, flag, value])
        assert result.exit_code == 2, (name, result.output)
        errors[name] = result.output.strip().splitlines()[-1]
    assert len(set(errors.values())) == 1, errors
    assert errors["generate"].startswith(f"Error: Invalid value for '{flag}'")


def test_bench_repeats_are_validated_one_by_one():
    result = CliRunner().invoke(cli, ["bench", "--block-size", "8", "--block-size", "0"])
    assert result.exit_code == 2 and "'--block-size': 0 is not in the range x>=1" in result.output


@click.command()
@engine_options()
def _probe(**options):
    """A command with the engine options only, to look at what they parse to."""


def _parse(*args: str) -> dict:
    return _probe.make_context("probe", list(args)).params


def test_parsed_options_build_the_engine_config_under_its_own_field_names():
    options = _parse("--kv-cache-memory", "2GiB", "--dtype", "half", "--no-prefix-caching", "--preemption", "swap",
                     "--no-cuda-graphs", "--sync-scheduling", "--admission-batch", "3", "--max-model-len", "64",
                     "--seed", "5", "--max-logprobs", "2", "--tensor-parallel-size", "2", "-m", "M")
    config = engine_config(options)
    assert (config.kv_cache_memory, config.dtype, config.enable_prefix_caching, config.preemption_mode) == \
        (2 << 30, "float16", False, "swap")
    assert (config.cuda_graphs, config.async_scheduling, config.admission_batch, config.max_model_len) == \
        (False, False, 3, 64)
    assert (config.seed, config.max_logprobs, config.tensor_parallel_size, config.model) == (5, 2, 2, "M")


def test_the_fp8_kv_cache_options_reach_the_engine_config():
    config = engine_config(_parse("--kv-cache-dtype", "fp8", "--calculate-kv-scales"))
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8", True)


def test_the_defaults_are_engine_configs_defaults():
    config, defaults = engine_config(_parse()), EngineConfig()
    for name in ENGINE_OPTION_NAMES:
        if name in EngineConfig.__dataclass_fields__ and name != "dtype":  # "auto" vs None: the same
            assert getattr(config, name) == getattr(defaults, name), name


def test_overrides_win_and_a_refused_value_is_a_usage_error():
    assert engine_config(_parse("--block-size", "8"), block_size=32, kv_layout="contiguous").block_size == 32
    with pytest.raises(click.UsageError, match="max_model_len must be at least 2"):
        engine_config(_parse(), max_model_len=1)


def test_every_engine_option_is_an_llm_argument_of_the_same_name():
    """eval hands the options to LLM(...) (through lm-eval's model_args) under these names."""
    llm_parameters = set(inspect.signature(LLM.__init__).parameters)
    config_fields = {f.name for f in fields(EngineConfig)}
    for name in ENGINE_OPTION_NAMES:
        assert name in config_fields or name in llm_parameters, name


def test_only_options_given_on_the_command_line_count_as_given():
    ctx = _probe.make_context("probe", ["--num-kv-blocks", "8", "--no-cuda-graphs"])
    assert given_engine_options(ctx) == {"num_kv_blocks": 8, "cuda_graphs": False}
    assert given_engine_options(_probe.make_context("probe", [])) == {}


def test_a_command_may_change_defaults_and_help_but_not_validation():
    with pytest.raises(ValueError, match=r"only \['default', 'help'\] may change per command, not \['type'\]"):
        engine_options(overrides={"block_size": {"type": int}})(lambda **kw: None)
    with pytest.raises(ValueError, match="not engine options"):
        engine_options(exclude=("temperature",))


@pytest.mark.parametrize("text, size", [("2GiB", 2 << 30), ("512 MiB", 512 << 20), ("1000", 1000),
                                        ("1.5kb", 1500)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "-1GiB", "0.1", "2PiB", "many", "", "nan", "inf"])
def test_parse_size_refuses_what_is_not_a_positive_size(text):
    with pytest.raises(click.BadParameter):
        parse_size(text)
