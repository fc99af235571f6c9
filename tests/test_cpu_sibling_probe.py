"""scripts/cpu_sibling_probe.py (session 52): which CPUs slow the step loop's CPU when busy."""
from __future__ import annotations

import json
import os

import pytest
from fixtures_scripts import load_script

probe = load_script("scripts/cpu_sibling_probe.py")


def test_siblings_are_the_cpus_over_the_threshold():
    assert probe.siblings({1: 1.02, 8: 1.6, 9: 1.151, 3: 0.97}, threshold=1.15) == [8, 9]
    assert probe.siblings({1: 1.0}, threshold=1.15) == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probe needs two CPUs")
def test_a_probe_of_this_host_names_every_other_cpu_and_unpins_this_process(capsys):
    allowed = os.sched_getaffinity(0)
    home = min(allowed)
    probe.main(["--home", str(home), "--repeats", "1", "--passes", "2", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"][0]
    assert result["home"] == home and result["alone_ms"] > 0
    assert sorted(int(cpu) for cpu in result["slowdowns"]) == sorted(allowed - {home})
    assert all(ratio > 0 for ratio in result["slowdowns"].values()) and result["all_busy"] > 0
    assert os.sched_getaffinity(0) == allowed


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="homes among"):
        probe.main(["--home", "4096"])
    with pytest.raises(SystemExit, match="passes >= 1"):
        probe.main(["--passes", "0"])
