"""Where a bench run loses against its roofline floor, by step kind and batch size (reads records, no device).

Reads `offline-paged bench --json --json-steps` records (plain or gzipped JSON, the record on the last line) and
prints, per run: the prefilling steps, then the decode-only steps in bins of sequences per step, each with its
steps, wall and device-forward seconds, the floor's seconds, the floor over the wall, and its share of the whole
run's loss (wall - floor). A bin's share says where a faster step would pay; its % of floor says how far it is.

    python benchmarks/step_losses.py RECORD.json[.gz] ... [--bins 1 17 65 129 193 257]
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def read_record(path: str) -> dict:
    """The bench record on the last line of `path` (gzipped when it ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        lines = handle.read().strip().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty")
    return json.loads(lines[-1])


def loss_table(steps: list[dict], bins: list[int]) -> list[tuple[str, int, float, float, float]]:
    """(label, steps, wall s, forward s, floor s) for the prefilling steps, then each decode bin
    [bins[i], bins[i+1]) of sequences per step (bins with no step are left out)."""
    def sums(label, chosen):
        return (label, len(chosen), sum(s["wall_s"] for s in chosen), sum(s["forward_s"] or 0.0 for s in chosen),
                sum(s["floor_s"] or 0.0 for s in chosen))

    rows = [sums("prefilling", [s for s in steps if s["num_tokens"] > s["num_seqs"]])]
    for low, high in zip(bins, bins[1:]):
        chosen = [s for s in steps if s["num_tokens"] == s["num_seqs"] and low <= s["num_seqs"] < high]
        rows.append(sums(f"decode {low}-{high - 1}", chosen))
    return [row for row in rows if row[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+")
    parser.add_argument("--bins", nargs="+", type=int, default=[1, 17, 65, 129, 193, 257],
                        help="edges of the sequences-per-step bins of decode-only steps")
    args = parser.parse_args()
    if sorted(args.bins) != args.bins or len(args.bins) < 2:
        parser.error("--bins needs at least two increasing edges")
    for path in args.records:
        record = read_record(path)
        for run in record["runs"]:
            steps = run.get("steps")
            if not steps or steps[0].get("floor_s") is None:
                raise SystemExit(f"{path}: run {run['label']!r} has no per-step floors "
                                 "(bench it with --json --json-steps and the roofline on)")
            wall = sum(s["wall_s"] for s in steps)
            loss = wall - sum(s["floor_s"] for s in steps)
            print(f"{Path(path).name}: {run['label']}, {run['output_tokens_per_s']:,.0f} out tok/s, "
                  f"{run['roofline']['fraction_of_floor']:.1%} of the floor, {len(steps)} steps, {wall:.3f} s")
            print(f"  {'steps':<18}{'count':>7}{'wall s':>9}{'fwd s':>9}{'floor s':>9}{'of floor':>10}"
                  f"{'ms/step':>9}{'loss share':>12}")
            for label, count, wall_s, forward_s, floor_s in loss_table(steps, args.bins):
                print(f"  {label:<18}{count:>7}{wall_s:>9.3f}{forward_s:>9.3f}{floor_s:>9.3f}{floor_s / wall_s:>10.1%}"
                      f"{1e3 * wall_s / count:>9.2f}{(wall_s - floor_s) / loss:>12.1%}")


if __name__ == "__main__":
    main()
