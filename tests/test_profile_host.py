"""benchmarks/profile_host.py --per-run: each bench run's step loop profiled apart, side by side (the device
diagnostic for the JSON step's extra host time), checked on the CPU with the tiny preset."""
from __future__ import annotations

import pytest
from fixtures_scripts import load_script


@pytest.fixture(scope="module")
def profile_host():
    return load_script("benchmarks/profile_host.py")


def test_each_structured_run_is_profiled_apart(profile_host, capsys):
    runs = profile_host.profile_each_run(["bench", "--device", "cpu", "--dummy-weights", "tiny", "--num-requests",
                                          "6", "--input-len", "8:16", "--output-len", "4:8", "--structured", "json"])
    assert [label for label, _, _ in runs] == ["paged", "paged json", "paged plain@json lengths"]
    grammar = [sum(s for f, s in own.items() if "LLMatcher" in f or "LLExecutor" in f) for _, _, own in runs]
    assert grammar[0] == 0 and grammar[1] > 0 and grammar[2] == 0  # only the constrained run runs the matchers
    capsys.readouterr()
    profile_host.print_per_run(runs, top=5)
    lines = capsys.readouterr().out.splitlines()
    assert "[1] paged json" in lines[0] and lines[1].split()[-2:] == ["[1]-[2]", "function"]
    assert len(lines) == 3 + 5 and lines[2].endswith("(all)")


def test_a_diff_naming_a_run_the_bench_did_not_run_is_refused(profile_host):
    with pytest.raises(SystemExit, match="--diff 1 3: the bench ran 2 run"):
        profile_host.print_per_run([("a", 1, {"f": 1.0}), ("b", 1, {"f": 2.0})], top=5, diff=(1, 3))
