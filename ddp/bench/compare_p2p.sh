#!/usr/bin/env bash
# Point-to-point ping-pong between 2 ranks: ProcessGroup::Send/Recv, the
# Communicator::Send/Recv underneath it, and PyTorch gloo's send/recv, run
# by run interleaved; prints the median one-way time per size and the
# ratios (gloo time / ours: how many times faster we are; pg / comm: what
# the process group adds to the transport).
#
#   ddp/bench/compare_p2p.sh [REPS]
#
# Needs: bazel build //ddp:p2p_bench; /usr/bin/python3 with torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPS=${1:-5}
BENCH=${P2P_BENCH:-bazel-bin/ddp/p2p_bench}
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg); $REPS runs each"
for _ in $(seq "$REPS"); do
  "$BENCH" --nproc_per_node=2 --mode=comm | awk '{print "comm", $1, $2}' >>"$OUT"
  "$BENCH" --nproc_per_node=2 --mode=pg | awk '{print "pg", $1, $2}' >>"$OUT"
  /usr/bin/python3 ddp/bench/torch_gloo_p2p.py | awk '{print "gloo", $1, $2}' >>"$OUT"
done
echo "# bytes | one-way us: pg, comm, gloo (medians) | pg/comm | gloo/pg"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    kind, size, us = line.split()
    runs[(kind, int(size))].append(float(us))
for size in sorted({s for _, s in runs}):
    pg, comm, gloo = (statistics.median(runs[(k, size)]) for k in ("pg", "comm", "gloo"))
    print(f"{size} | {pg:.1f} {comm:.1f} {gloo:.1f} | {pg / comm:.2f} | {gloo / pg:.2f}")
PY
