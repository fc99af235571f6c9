"""benchmarks/profile_kernels.py's launch-gap table (the GPU profile's post-processing), on made-up trace events."""
from __future__ import annotations

import pytest
from fixtures_scripts import load_script

pytest.importorskip("torch")  # the script imports torch's profiler


def event(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel", "args": {"device": 0, "stream": stream}}


def test_gaps_are_summed_by_kernel_pair_within_each_stream(capsys):
    profile_kernels = load_script("benchmarks/profile_kernels.py")
    events = [event("gemm<float>", 0, 10), event("rms_norm_f16(x)", 11.5, 2), event("gemm<float>", 14, 10),
              event("rms_norm_f16(x)", 25, 2),  # gemm -> rms_norm twice (1.5, 1.0 us), rms_norm -> gemm once (0.5)
              event("sample", 500, 5),  # 473 us after: a host wait, not a launch gap
              event("other", 12, 1, stream=8)]  # another stream: no gap with stream 7's kernels
    profile_kernels.print_gaps(events, gap_us=20.0, top=5)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "over 3 boundaries, median 1.00 us" in lines[0]
    rows = {line.split(" -> ")[0]: line.split() for line in lines[2:]}
    assert rows["gemm"][-2:] == ["2", "1.25"] and rows["rms_norm_f16"][-2:] == ["1", "0.50"]


def test_no_gaps_print_nothing(capsys):
    profile_kernels = load_script("benchmarks/profile_kernels.py")
    profile_kernels.print_gaps([event("a", 0, 1), event("b", 100, 1)], gap_us=20.0, top=5)
    assert capsys.readouterr().out == ""
