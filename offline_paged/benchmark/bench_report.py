"""Formatting of BenchResults: a text report with ratios against the first run, and the KV plot."""
from __future__ import annotations

import statistics

from offline_paged.benchmark.bench import BenchResult

GiB = 1 << 30


def format_report(results: list[BenchResult], header: str = "") -> str:
    """One table row per run (ratios against the first run), then each run's details."""
    lines = [header] if header else []
    base = results[0]
    width = max(22, *(len(r.label) + 2 for r in results))
    lines.append(f"{'run':<{width}}{'out tok/s':>12}{'total tok/s':>13}{'wall s':>9}{'max seqs':>10}"
                 f"{'KV util':>9}{'preempt':>9}{'vs ' + base.label:>16}")
    for r in results:
        ratio = r.output_tokens_per_s / base.output_tokens_per_s
        lines.append(f"{r.label:<{width}}{r.output_tokens_per_s:>12,.0f}{r.total_tokens_per_s:>13,.0f}"
                     f"{r.wall_s:>9.2f}{r.max_concurrent_seqs:>10}{r.kv_utilization:>9.1%}"
                     f"{r.num_preemptions:>9}{ratio:>15.2f}x")
    lines += format_medians(results)
    lines += format_like_for_like(results)
    for r in results:
        lines += ["", *format_details(r)]
    return "\n".join(lines)


def format_medians(results: list[BenchResult]) -> list[str]:
    """Runs labelled "... #k" (bench --repeat): per configuration, the median out tok/s and step ms over its
    repeats, and the median's ratio to the first configuration's. [] when nothing was repeated."""
    groups: dict[str, list[BenchResult]] = {}
    for r in results:
        name, _, repeat = r.label.rpartition(" #")
        if not (name and repeat.isdigit()):
            return []
        groups.setdefault(name, []).append(r)
    medians = {name: (statistics.median(r.output_tokens_per_s for r in runs),
                      statistics.median(r.time_split()["step_ms"] for r in runs) if all(r.steps for r in runs) else None)
               for name, runs in groups.items()}
    base_name = next(iter(medians))
    width = max(22, *(len(name) + 2 for name in medians))
    lines = ["", f"{'median of repeats':<{width}}{'out tok/s':>12}{'step ms':>9}{'runs':>6}{'vs ' + base_name:>16}"]
    for name, (tok_s, step_ms) in medians.items():
        step = f"{step_ms:>9.2f}" if step_ms is not None else f"{'-':>9}"
        lines.append(f"{name:<{width}}{tok_s:>12,.0f}{step}{len(groups[name]):>6}"
                     f"{tok_s / medians[base_name][0]:>15.2f}x")
    return lines


def format_like_for_like(results: list[BenchResult]) -> list[str]:
    """bench --structured: each constrained run's out tok/s against the "plain@<kind> lengths" run of its
    configuration and repeat (unconstrained, to the same output lengths), and the median ratio per
    constrained configuration over the repeats. [] without such runs."""
    ratios: dict[str, list[float]] = {}
    lines = []
    for reference in results:
        prefix, marker, rest = reference.label.partition(" plain@")
        if not marker:
            continue
        kind, _, suffix = rest.partition(" lengths")  # suffix: "" or " #k"
        for r in results:
            name = r.label.removesuffix(suffix) if suffix else r.label
            if r is not reference and (not suffix or r.label.endswith(suffix)) and name.startswith(
                    f"{prefix} {kind}") and " plain@" not in name:
                ratio = r.output_tokens_per_s / reference.output_tokens_per_s
                ratios.setdefault(name, []).append(ratio)
                lines.append(f"{r.label:<30}{ratio:>8.2f}x of {reference.label}")
    if not lines:
        return []
    if any(len(values) > 1 for values in ratios.values()):
        lines += [f"{name + ' (median)':<30}{statistics.median(values):>8.2f}x over {len(values)} repeats"
                  for name, values in ratios.items()]
    return ["", "like for like (constrained / unconstrained at the same output lengths)", *lines]


def format_details(r: BenchResult) -> list[str]:
    split = r.time_split()
    memory = "n/a (CPU)" if r.peak_device_memory is None else f"{r.peak_device_memory / GiB:.2f} GiB"
    out = [
        f"== {r.label}: {r.kv_layout} KV, block size {r.block_size}, {r.num_gpu_blocks} blocks, "
        f"max_model_len {r.max_model_len}",
        f"requests {r.num_requests}  prompt tokens {r.num_prompt_tokens:,}  output tokens "
        f"{r.num_output_tokens:,}  wall {r.wall_s:.2f} s",
        f"output {r.output_tokens_per_s:,.1f} tok/s  total {r.total_tokens_per_s:,.1f} tok/s  "
        f"peak device memory {memory}",
        f"KV utilization {r.kv_utilization:.1%} (filled slots / held slots, mean over steps)  "
        f"block usage {r.kv_block_usage:.1%} of the pool  max concurrent seqs {r.max_concurrent_seqs}  "
        f"preemptions {r.num_preemptions}",
        _format_split(split) if r.steps else "per step: not recorded (the steps ran in worker processes)",
    ]
    if r.steps and r.steps[0].forward_s is not None:  # measured on the device
        out.append(_format_kinds(r.step_kinds()))
    if r.host_load is not None:
        out.append(_format_host_load(r.host_load))
    if r.errors:
        out.append(f"{len(r.errors)} request(s) ended with an error (not counted in the tokens), first: {r.errors[0]}")
    roof = r.roofline()
    if roof is not None:
        out.append(
            f"roofline: floor {roof['floor_s']:.2f} s ({roof['output_tokens_per_s_at_floor']:,.0f} out tok/s) "
            f"= {roof['fraction_of_floor']:.1%} of the floor reached; measured {roof['bandwidth_gb_s']:,.0f} GB/s, "
            f"{roof['matmul_tflop_s']:,.1f} TFLOP/s ({roof['ceilings']})")
    return out


def _format_host_load(load: dict) -> str:
    text = f"step loop thread: {load['thread_cpu_ms']:.2f} ms of CPU a step"
    if load["thread_cpu_share"] is not None:
        text += f" ({load['thread_cpu_share']:.0%} of the wall)"
    if load["involuntary_switches"] is not None:
        text += (f", {load['voluntary_switches']:.2f} voluntary and {load['involuntary_switches']:.2f} involuntary "
                 f"context switches a step")
    if load["host_steal_share"] is not None:
        text += f"; the host's steal {load['host_steal_share']:.1%}"
    return text


def _format_split(split: dict) -> str:
    rest = split['step_ms'] - split['schedule_ms'] - split['execute_ms'] - split['postprocess_ms']
    prefill = split.get("num_prefill_graph_steps")
    text = (f"per step ({split['num_steps']} steps, {split['num_cuda_graph_steps']} from CUDA graphs"
            + (f", {prefill} of them prefilling" if prefill else "") + "): "
            f"{split['step_ms']:.2f} ms = schedule {split['schedule_ms']:.2f} + execute "
            f"{split['execute_ms']:.2f} + postprocess {split['postprocess_ms']:.2f} + rest {rest:.2f}")
    if split["forward_device_ms"] is not None:
        text += (f"; forward on the device {split['forward_device_ms']:.2f} ms, host-only "
                 f"{split['host_ms']:.2f} ms ({split['host_ms'] / max(split['step_ms'], 1e-12):.0%})")
    if split.get("device_idle_ms") is not None:
        text += f", device idle between forwards {split['device_idle_ms']:.3f} ms"
    return text


def _format_kinds(kinds: dict) -> str:
    parts = [f"{kind} {k['num_steps']} ({k['tokens']:.0f} tokens, wall {k['wall_ms']:.2f} ms, launch "
             f"{k['execute_ms']:.2f}, forward {k['forward_device_ms']:.2f}, host-only "
             + ("n/a" if k["host_only_share"] is None else f"{k['host_only_share']:.0%}") + ")"
             for kind, k in kinds.items()]
    return "steps by kind: " + "; ".join(parts)


def plot_kv(results: list[BenchResult], path: str) -> None:
    """PNG: KV blocks held vs blocks' worth of filled slots over time, one panel per run.

    Raises RuntimeError when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], results):
        times = [s.end_s for s in r.steps]
        ax.plot(times, [s.blocks_held for s in r.steps], label="blocks allocated (held)")
        ax.plot(times, [s.blocks_filled for s in r.steps], label="blocks in use (filled slots / B)")
        ax.axhline(r.num_gpu_blocks, color="grey", linestyle="--", label="pool")
        ax.set_title(f"{r.label}: {r.output_tokens_per_s:,.0f} out tok/s, max {r.max_concurrent_seqs} seqs")
        ax.set_xlabel("time (s)")
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("KV blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
