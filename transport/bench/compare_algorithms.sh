#!/usr/bin/env bash
# The UCX all-reduce algorithms side by side (the shared-memory path off by
# forcing each algorithm), interleaved run by run; prints the median time
# per size and which algorithm was fastest, the evidence behind the
# selection table in transport/algorithms/selection.cc.
#
#   transport/bench/compare_algorithms.sh [REPS] [NPROC...]
#
# Needs: bazel build //examples:allreduce_bench. The runs pass --check: a
# wrong element fails the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=compare_algorithms USAGE="compare_algorithms.sh [REPS] [NPROC...]"
source transport/bench/bench_common.sh
REPS=${1:-3}
shift || true
if [ $# -gt 0 ]; then NPROCS=("$@"); else NPROCS=(2 4); fi
positive_int REPS "$REPS"
for np in "${NPROCS[@]}"; do positive_int NPROC "$np"; done
BENCH=bazel-bin/examples/allreduce_bench
need_executable "$BENCH" "bazel build //examples:allreduce_bench"
OUT=$WORK/runs
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$REPS"); do
  for np in "${NPROCS[@]}"; do
    for algo in ring tree rhd auto; do
      # --check: one more call per size after the timed ones, not timed.
      run "$BENCH" --nproc_per_node="$np" --algo="$algo" --min_bytes=4K --max_bytes=16M \
        --step_factor=4 --check
      rows | awk -v np="$np" -v a="$algo" '{print np, a, $1, $4}' >>"$OUT"
    done
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    np, algo, size, us = line.split()
    runs[(int(np), algo, int(size))].append(float(us))
algos = ["ring", "tree", "rhd", "auto"]
for np in sorted({k[0] for k in runs}):
    print(f"\n{np} ranks: median time_us over runs")
    print("| bytes | ring | tree | rhd | auto (shm on one host) | fastest of ring/tree/rhd |")
    print("| --- |" + " --- |" * (len(algos) + 1))
    for size in sorted({k[2] for k in runs if k[0] == np}):
        med = {a: statistics.median(runs[(np, a, size)]) for a in algos if runs.get((np, a, size))}
        best = min((a for a in med if a != "auto"), key=lambda a: med[a])
        print(f"| {size} | " + " | ".join(f"{med[a]:.1f}" if a in med else "-" for a in algos) +
              f" | {best} |")
PY
