#!/usr/bin/env bash
# The hierarchical all-reduce between two "hosts" that talk over TCP: two
# network namespaces joined by a veth pair, each with its own host name and
# two ranks, started by one ddprun per host as on real machines. Compares
# the steps inside each host in shared memory against the same over UCX
# (DDP_SHARED_MEMORY=0), interleaved run by run; prints the median time per
# size and the ratio. Needs root (ip netns) and:
#   bazel build //transport/launch:ddprun //examples:allreduce_bench
#
#   transport/bench/netns_hierarchical.sh [REPS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=netns_hierarchical USAGE="netns_hierarchical.sh [REPS]"
source transport/bench/bench_common.sh
REPS=${1:-3}
positive_int REPS "$REPS"
DDPRUN=$PWD/bazel-bin/transport/launch/ddprun
BENCH=$PWD/bazel-bin/examples/allreduce_bench
for f in "$DDPRUN" "$BENCH"; do
  need_executable "$f" "bazel build //transport/launch:ddprun //examples:allreduce_bench"
done
A=ddpbenchA$$ B=ddpbenchB$$ DEV=ddp0 ADDR_A=10.232.0.1 ADDR_B=10.232.0.2 PORT=29655
# Every temporary file under $WORK, removed on any exit (the two hosts'
# outputs were left behind when a run failed).
OUT=$WORK/runs
source transport/bench/netns_hosts.sh
cleanup() {
  netns_hosts_down
  bench_cleanup
}
trap cleanup EXIT
netns_hosts_up

# One run: both hosts' launchers; host 0 (rank 0) prints the table.
one_run() {
  local shm=$1 node ns pids=()
  for node in 0 1; do
    ns=$A
    [ $node = 1 ] && ns=$B
    ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "bench-node$node" \
      env DDP_JOB_TOKEN=bench DDP_SHARED_MEMORY="$shm" UCX_NET_DEVICES=$DEV \
      "$DDPRUN" --nnodes=2 --node_rank=$node --master_addr=$ADDR_A --master_port=$PORT \
      --nproc_per_node=2 "$BENCH" --algo=hierarchical --min_bytes=4K --max_bytes=16M \
      --step_factor=4 --check >"$WORK/host.$node" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  if [ $failed = 1 ]; then echo "$SCRIPT: a run failed:" >&2; cat "$WORK/host.0" "$WORK/host.1" >&2; exit 1; fi
  # ddprun prefixes each line with "[rank] ".
  sed "s/^\[[0-9]*\] //" "$WORK/host.0" | grep -E "^ *[0-9]" | awk -v shm="$shm" '{print shm, $1, $4, $7}' >>"$OUT"
}

echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$REPS"); do
  for shm in 1 0; do one_run "$shm"; done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
wrong = 0
for line in open(sys.argv[1]):
    shm, size, us, bad = line.split()
    runs[(shm, int(size))].append(float(us))
    wrong += int(bad)
print(f"wrong elements over all runs: {wrong}")
print("| bytes | shared memory inside hosts (us) | UCX inside hosts (us) | speed-up |")
print("| --- | --- | --- | --- |")
for size in sorted({k[1] for k in runs}):
    if not runs[("1", size)] or not runs[("0", size)]:
        continue
    a, b = statistics.median(runs[("1", size)]), statistics.median(runs[("0", size)])
    print(f"| {size} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
PY
