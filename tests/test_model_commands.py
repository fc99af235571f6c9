"""`offline-paged pull` and `convert` (cli/model_commands.py): the path on stdout, --force passed on, and
every failure of the model layer as `error: ...` with exit 2. The model layer is faked here; it has its
own tests (test_default_model.py, test_gguf_import.py); test_errors.py runs a real failing convert."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

import offline_paged.models.convert as convert_module
import offline_paged.models.default_model as default_model
from offline_paged.cli.main import cli


@pytest.mark.parametrize("args, force", [([], False), (["--force"], True)])
def test_pull_prints_the_cached_path_and_passes_force(monkeypatch, tmp_path, args, force):
    calls = []
    monkeypatch.setattr(default_model, "pull", lambda force: calls.append(force) or tmp_path / "smollm2")
    result = CliRunner().invoke(cli, ["pull", *args])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "smollm2") and calls == [force]


@pytest.mark.parametrize("exc", [RuntimeError("sha256 mismatch"), ValueError("sha256 mismatch"),
                                 OSError("sha256 mismatch")])
def test_pull_failures_are_error_colon_exit_2(monkeypatch, exc):
    def fail(force):
        raise exc

    monkeypatch.setattr(default_model, "pull", fail)
    result = CliRunner().invoke(cli, ["pull"])
    assert result.exit_code == 2 and result.output == "error: sha256 mismatch\n"


def test_convert_passes_both_paths_and_prints_the_result(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(convert_module, "convert_gguf", lambda src, dst: calls.append((src, dst)) or dst)
    src, dst = str(tmp_path / "m.gguf"), str(tmp_path / "out")
    result = CliRunner().invoke(cli, ["convert", src, dst])
    assert result.exit_code == 0, result.output
    assert calls == [(src, dst)] and result.output.strip() == dst


def test_convert_value_error_is_error_colon_exit_2(monkeypatch, tmp_path):
    def fail(src, dst):
        raise ValueError(f"{src}: not a llama GGUF (general.architecture = 'gpt2')")

    monkeypatch.setattr(convert_module, "convert_gguf", fail)
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output == f"error: {tmp_path / 'm.gguf'}: not a llama GGUF (general.architecture = 'gpt2')\n"


def test_convert_needs_both_arguments():
    result = CliRunner().invoke(cli, ["convert", "only.gguf"])
    assert result.exit_code == 2 and "Missing argument 'OUTDIR'" in result.output
