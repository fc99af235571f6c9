"""`offline-paged eval` (cli/eval.py): hands lm-eval's `run` every flag unchanged, defaults --model to
our backend, and is a clear exit-2 error when lm-eval is missing. lm-eval itself is faked here;
test_lm_eval.py runs the real one."""
from __future__ import annotations

import sys
import types

import pytest
from click.testing import CliRunner

from offline_paged.cli.main import cli


@pytest.fixture
def fake_lm_eval(monkeypatch):
    """lm_eval.__main__.cli_evaluate records sys.argv; our backend's registering import is a no-op."""
    seen: list[list[str]] = []
    main = types.ModuleType("lm_eval.__main__")
    main.cli_evaluate = lambda: seen.append(list(sys.argv))
    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", main)
    monkeypatch.setitem(sys.modules, "offline_paged.entrypoints.lm_eval", types.ModuleType("registers"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command rewrites sys.argv
    return seen


def test_flags_go_to_lm_eval_run_with_our_model_by_default(fake_lm_eval):
    args = ["--tasks", "hellaswag", "--model_args", "pretrained=/m,dtype=float32", "--limit", "7"]
    result = CliRunner().invoke(cli, ["eval", *args])
    assert result.exit_code == 0, result.output
    assert fake_lm_eval == [["offline-paged eval", "run", "--model", "offline-paged", *args]]


@pytest.mark.parametrize("model_flag", [["--model", "hf"], ["-M", "hf"], ["--model=hf"]])
def test_an_explicit_model_is_left_alone(fake_lm_eval, model_flag):
    result = CliRunner().invoke(cli, ["eval", *model_flag, "--tasks", "x"])
    assert result.exit_code == 0, result.output
    assert fake_lm_eval == [["offline-paged eval", "run", *model_flag, "--tasks", "x"]]


def test_help_prints_ours_then_passes_help_to_lm_eval(fake_lm_eval):
    result = CliRunner().invoke(cli, ["eval", "--help"])
    assert result.exit_code == 0, result.output
    assert "lm-eval's run flags" in result.output and "lm-evaluation-harness" in result.output
    assert fake_lm_eval == [["offline-paged eval", "run", "--help"]]


def test_missing_lm_eval_is_error_colon_and_exit_2(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "offline_paged.entrypoints.lm_eval", types.ModuleType("registers"))
    result = CliRunner().invoke(cli, ["eval", "--tasks", "x"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: lm-eval is not installed") and "offline-paged[eval]" in result.output


def test_an_error_inside_lm_eval_is_one_error_line_and_exit_2(fake_lm_eval, monkeypatch):
    def fails():
        raise ValueError("Tasks not found: nosuchtask")

    monkeypatch.setattr(sys.modules["lm_eval.__main__"], "cli_evaluate", fails)
    result = CliRunner().invoke(cli, ["eval", "--tasks", "nosuchtask"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.startswith("error: lm-eval stopped: ValueError: Tasks not found: nosuchtask")


def test_lm_evals_default_cuda_device_falls_back_to_auto_without_cuda(monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    from offline_paged.entrypoints import lm_eval as backend
    from offline_paged.worker import backend as worker_backend

    monkeypatch.setattr(worker_backend, "cuda_available", lambda: False)
    assert backend._device("cuda") == "auto" and backend._device("cuda:0") == "auto"
    assert "no CUDA device" in capsys.readouterr().err
    assert backend._device("cpu") == "cpu" and backend._device(None) == "auto"
    monkeypatch.setattr(worker_backend, "cuda_available", lambda: True)
    assert backend._device("cuda:1") == "cuda"


def test_engine_options_given_go_to_our_backend_as_one_more_model_args(fake_lm_eval):
    args = ["--tasks", "x", "--model_args", "pretrained=/m", "--num-kv-blocks", "64", "--dtype", "half",
            "--no-cuda-graphs", "--kv-cache-memory", "1MiB", "--limit", "3"]
    result = CliRunner().invoke(cli, ["eval", *args])
    assert result.exit_code == 0, result.output
    ours = "dtype=float16,num_kv_blocks=64,kv_cache_memory=1048576,cuda_graphs=False"  # declaration order
    assert fake_lm_eval == [["offline-paged eval", "run", "--model", "offline-paged", "--tasks", "x",
                             "--model_args", "pretrained=/m", "--limit", "3", "--model_args", ours]]


def test_lm_eval_reads_the_forwarded_model_args_back_as_typed_values():
    utils = pytest.importorskip("lm_eval._cli.utils")
    assert utils.key_val_to_dict("dtype=float16,num_kv_blocks=64,kv_cache_memory=1048576,cuda_graphs=False,"
                                 "gpu_memory_utilization=0.5,preemption_mode=swap") == {
        "dtype": "float16", "num_kv_blocks": 64, "kv_cache_memory": 1048576, "cuda_graphs": False,
        "gpu_memory_utilization": 0.5, "preemption_mode": "swap"}


def test_engine_options_with_another_lm_eval_model_are_refused(fake_lm_eval):
    result = CliRunner().invoke(cli, ["eval", "--model", "hf", "--num-kv-blocks", "64", "--tasks", "x"])
    assert result.exit_code == 2 and "--num-kv-blocks: engine options of offline-paged's backend" in result.output
    assert fake_lm_eval == []


def test_help_lists_the_engine_options(fake_lm_eval):
    result = CliRunner().invoke(cli, ["eval", "--help"])
    assert "--num-kv-blocks" in result.output and "--admission-batch" in result.output
