#!/usr/bin/env bash
# The hierarchical all-reduce with its steps inside each host in shared
# memory against the same over UCX (DDP_SHARED_MEMORY=0), interleaved run by
# run; prints the median time per size and the ratio. The hosts are
# described by a topology file (two hosts of two ranks each), so both run on
# this machine: the step between hosts goes over UCX's shared-memory
# transports here, over the network on real hosts.
#
#   transport/bench/compare_hierarchical.sh [REPS]
#
# Needs: bazel build //examples:allreduce_bench. The runs pass --check: a
# wrong element fails the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=compare_hierarchical USAGE="compare_hierarchical.sh [REPS]"
source transport/bench/bench_common.sh
REPS=${1:-5}
positive_int REPS "$REPS"
BENCH=bazel-bin/examples/allreduce_bench
need_executable "$BENCH" "bazel build //examples:allreduce_bench"
OUT=$WORK/runs
TOPOLOGY=$WORK/topology.json
cat >"$TOPOLOGY" <<'JSON'
{"hosts": [{"name": "a"}, {"name": "b"}],
 "ranks": [{"host": 0}, {"host": 0}, {"host": 1}, {"host": 1}]}
JSON
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$REPS"); do
  for shm in 1 0; do
    # --check: one more call per size after the timed ones, not timed.
    run DDP_SHARED_MEMORY=$shm DDP_TOPOLOGY_FILE=$TOPOLOGY "$BENCH" --nproc_per_node=4 \
      --algo=hierarchical --min_bytes=4K --max_bytes=16M --step_factor=4 --check
    rows | awk -v shm="$shm" '{print shm, $1, $4}' >>"$OUT"
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    shm, size, us = line.split()
    runs[(shm, int(size))].append(float(us))
print("| bytes | shared memory inside hosts (us) | UCX inside hosts (us) | speed-up |")
print("| --- | --- | --- | --- |")
for size in sorted({k[1] for k in runs}):
    a, b = statistics.median(runs[("1", size)]), statistics.median(runs[("0", size)])
    print(f"| {size} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
PY
