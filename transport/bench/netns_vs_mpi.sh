#!/usr/bin/env bash
# All-reduce between two "hosts" that talk over TCP, against Open MPI on the
# same hosts: two network namespaces joined by a veth pair, each with its own
# host name, NPROC ranks per host. Ours: one ddprun per host. Open MPI:
# mpirun in the first namespace, starting its daemon in the second through
# an rsh agent that enters that namespace (as ssh would enter a machine),
# with UCX on the same device (the peers' MPI over UCX; within a host UCX
# may use shared memory). Runs alternate, REPS of each; prints the median
# time per size (rank 0's, as the MPI peer prints it) and Open MPI's time
# over ours. Needs root (ip netns) and:
#   bazel build -c opt //transport/launch:ddprun //examples:allreduce_bench
#   mpicc -O2 -o /tmp/mpi_allreduce ../shared/peers/mpi_allreduce.c
#
#   transport/bench/netns_vs_mpi.sh [REPS] [NPROC] [-- extra allreduce_bench flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=netns_vs_mpi USAGE="netns_vs_mpi.sh [REPS] [NPROC] [-- extra allreduce_bench flags]"
source transport/bench/bench_common.sh
REPS=${1:-3}
NPROC=${2:-1}
shift $(( $# >= 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
positive_int REPS "$REPS"
positive_int NPROC "$NPROC"
DDPRUN=$PWD/bazel-bin/transport/launch/ddprun
BENCH=$PWD/bazel-bin/examples/allreduce_bench
MPI_BENCH=${MPI_BENCH:-/tmp/mpi_allreduce}
SIZES="4096 65536 1048576 16777216"
A=ddpmpiA$$ B=ddpmpiB$$ DEV=ddp0 ADDR_A=10.233.0.1 ADDR_B=10.233.0.2 PORT=29656
source transport/bench/netns_hosts.sh
cleanup() {
  netns_hosts_down
  bench_cleanup
}
trap cleanup EXIT
for f in "$DDPRUN" "$BENCH" "$MPI_BENCH"; do
  [ -x "$f" ] || { echo "netns_vs_mpi: $f is missing (see the header for how to build it)" >&2; exit 2; }
done
netns_hosts_up

# mpirun's rsh agent: "host command..." runs the command in that host's
# namespace under that host's name (so that UCX does not take the two
# namespaces for one machine).
cat >"$WORK/agent.sh" <<EOF
#!/bin/sh
host=\$1; shift
case "\$host" in
  $ADDR_A) ns=$A name=bench-node0 ;;
  $ADDR_B) ns=$B name=bench-node1 ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$name" "\$*"
EOF
chmod +x "$WORK/agent.sh"

ours() {
  local node ns pids=()
  for node in 0 1; do
    ns=$A
    [ $node = 1 ] && ns=$B
    ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "bench-node$node" \
      env DDP_JOB_TOKEN=bench UCX_NET_DEVICES=$DEV timeout 300 \
      "$DDPRUN" --nnodes=2 --node_rank=$node --master_addr=$ADDR_A --master_port=$PORT \
      --nproc_per_node="$NPROC" "$BENCH" --min_bytes=4K --max_bytes=16M --step_factor=16 \
      --check --time_of=rank0 "${EXTRA[@]}" >"$WORK/ours.$node" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  if [ $failed = 1 ]; then echo "our run failed:" >&2; cat "$WORK/ours.0" "$WORK/ours.1" >&2; exit 1; fi
  # ddprun prefixes each line with "[rank] ": bytes, time, wrong elements.
  sed "s/^\[[0-9]*\] //" "$WORK/ours.0" | grep -E "^ *[0-9]" | awk '{print "ours", $1, $4, $7}' >>"$WORK/runs"
}

# $1: mpi (Open MPI as it starts by default: it spins while waiting, as it
# thinks each host has a core per rank) or mpi_yield (mpi_yield_when_idle,
# its setting for oversubscribed hosts).
mpi() {
  local yield=0
  [ "$1" = mpi_yield ] && yield=1
  # Host A is the one mpirun runs on, under its name as well.
  ip netns exec "$A" unshare --uts sh -c 'hostname bench-node0 && exec "$@"' sh \
    timeout 300 mpirun --allow-run-as-root --host "$ADDR_A:$NPROC,$ADDR_B:$NPROC" -np $((2 * NPROC)) \
    --mca plm_rsh_agent "$WORK/agent.sh" --mca oob_tcp_if_include $DEV --mca mpi_yield_when_idle $yield \
    --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any -x UCX_NET_DEVICES=$DEV \
    "$MPI_BENCH" $SIZES >"$WORK/mpi.out" 2>&1 || { echo "Open MPI run failed:" >&2; cat "$WORK/mpi.out" >&2; exit 1; }
  grep -E "^[0-9]+ " "$WORK/mpi.out" | awk -v who="$1" '{print who, $1, $4, 0}' >>"$WORK/runs"
}

echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg); $NPROC rank(s) per host; ours: ${EXTRA[*]:-defaults}"
for rep in $(seq "$REPS"); do
  ours
  mpi mpi
  mpi mpi_yield
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$WORK/runs" "$SIZES" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
wrong = 0
for line in open(sys.argv[1]):
    who, size, us, bad = line.split()
    runs[(who, int(size))].append(float(us))
    wrong += int(bad)
print(f"wrong elements over all our runs: {wrong}")
print("| bytes | ours (us) | Open MPI over UCX (us) | Open MPI, yield when idle (us) | Open MPI / ours | yielding Open MPI / ours |")
print("| --- | --- | --- | --- | --- | --- |")
for size in map(int, sys.argv[2].split()):
    if not all(runs[(who, size)] for who in ("ours", "mpi", "mpi_yield")):
        continue
    a, b, c = (statistics.median(runs[(who, size)]) for who in ("ours", "mpi", "mpi_yield"))
    print(f"| {size} | {a:.1f} | {b:.1f} | {c:.1f} | {b / a:.2f}x | {c / a:.2f}x |")
PY
