#!/usr/bin/env bash
# Before and after on one machine, in one call: `offline-paged bench` of a base tree (default: the device
# copy's git HEAD, i.e. what has landed) and of the working tree, on the same runs of
# scripts/device_throughput.sh (so a refactor's "within noise" is measured, not assumed).
#
# Usage: OUT=/tmp/out [BASE=<rev>] [RUNS="1b_graphs 8b_graphs"] scripts/device_compare.sh
# Records: $OUT/base/bench_records.tgz and $OUT/new/bench_records.tgz, each with its table printed.
set -u
OUT=${OUT:-/tmp/compare-out}
BASE=${BASE:-HEAD}
RUNS=${RUNS:-"1b_graphs 8b_graphs"}
HERE=$(pwd)
mkdir -p "$OUT/base" "$OUT/new"
rm -rf /tmp/base-tree
git worktree add --detach /tmp/base-tree "$BASE" >/dev/null 2>&1 || { echo "no worktree of $BASE"; exit 1; }
echo "base: $(git -C /tmp/base-tree log -1 --format='%h %s' | cut -c1-90)"
# The base tree's own script when it has one (it installs that tree editable and runs its benches).
(cd /tmp/base-tree && OUT="$OUT/base" RUNS="$RUNS" bash "$HERE/scripts/device_throughput.sh" bench) \
  | sed 's/^/base  /'
echo "new: the working tree"
OUT="$OUT/new" RUNS="$RUNS" bash scripts/device_throughput.sh bench | sed 's/^/new   /'
