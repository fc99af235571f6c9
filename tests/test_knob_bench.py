"""scripts/knob_bench.py sets the named attributes before the CLI runs, and refuses a name or value it cannot set."""
from __future__ import annotations

import pytest
from fixtures_scripts import load_script

from offline_paged.engine import LLMEngine

KNOB = "offline_paged.engine.LLMEngine.launch_ahead"


@pytest.fixture
def knob_bench(monkeypatch):
    monkeypatch.setattr(LLMEngine, "launch_ahead", LLMEngine.launch_ahead)
    return load_script("scripts/knob_bench.py")


def test_a_class_attribute_is_set_before_the_cli_runs(knob_bench, monkeypatch):
    seen = []
    monkeypatch.setattr("offline_paged.cli.main.cli", lambda argv, prog_name: seen.append(
        (argv, LLMEngine.launch_ahead)))
    knob_bench.main([f"{KNOB}=False", "bench", "--device", "cpu"])
    assert seen == [(["bench", "--device", "cpu"], False)]


@pytest.mark.parametrize("argv, message", [
    ([f"{KNOB}x=True", "bench"], "does not exist"),
    (["no_such_module.X=1", "bench"], "no module to import"),
    ([f"{KNOB}=yes", "bench"], "not a Python literal"),
    (["bench", f"{KNOB}=True"], "usage"),
])
def test_what_it_cannot_set_is_refused(knob_bench, argv, message):
    with pytest.raises(SystemExit, match=message):
        knob_bench.main(argv)
    assert LLMEngine.launch_ahead is True


def test_run_with_knobs_takes_none_too(knob_bench, monkeypatch):
    seen = []
    monkeypatch.setattr("offline_paged.cli.main.cli", lambda argv, prog_name: seen.append(argv))
    knob_bench.run_with_knobs(["bench", "--device", "cpu"])
    assert seen == [["bench", "--device", "cpu"]]
