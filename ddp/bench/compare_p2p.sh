#!/usr/bin/env bash
# Point-to-point ping-pong between 2 ranks: ProcessGroup::Send/Recv, the
# Communicator::Send/Recv underneath it, PyTorch gloo's send/recv and Open
# MPI's MPI_Send/MPI_Recv over UCX, run by run interleaved; prints the median
# one-way time per size and the ratios (peer time / ours: how many times
# faster we are; pg / comm: what the process group adds to the transport).
#
#   ddp/bench/compare_p2p.sh [REPS]
#
# Needs: bazel build //ddp:p2p_bench; /usr/bin/python3 with torch; mpicc
# and mpirun (openmpi-bin, libopenmpi-dev).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPS=${1:-5}
BENCH=${P2P_BENCH:-bazel-bin/ddp/p2p_bench}
OUT=$(mktemp)
MPI=$(mktemp)
trap 'rm -f "$OUT" "$MPI"' EXIT
# What is missing, said before the first run.
[ -x "$BENCH" ] || { echo "compare_p2p: no $BENCH; bazel build //ddp:p2p_bench" >&2; exit 1; }
/usr/bin/python3 -c 'import torch' 2>/dev/null ||
  { echo "compare_p2p: /usr/bin/python3 cannot import torch (apt-get install python3-torch)" >&2; exit 1; }
command -v mpicc >/dev/null && command -v mpirun >/dev/null ||
  { echo "compare_p2p: needs mpicc and mpirun (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; }
mpicc -O2 -o "$MPI" ddp/bench/mpi_p2p.c
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg); $REPS runs each"
for _ in $(seq "$REPS"); do
  "$BENCH" --nproc_per_node=2 --mode=comm | awk '{print "comm", $1, $2}' >>"$OUT"
  "$BENCH" --nproc_per_node=2 --mode=pg | awk '{print "pg", $1, $2}' >>"$OUT"
  /usr/bin/python3 ddp/bench/torch_gloo_p2p.py | awk '{print "gloo", $1, $2}' >>"$OUT"
  mpirun --allow-run-as-root --oversubscribe --mca pml ucx --mca pml_ucx_tls any \
    --mca pml_ucx_devices any -np 2 "$MPI" | awk '{print "mpi", $1, $2}' >>"$OUT"
done
echo "# bytes | one-way us: pg, comm, gloo, mpi (medians) | pg/comm | gloo/pg | mpi/pg"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    kind, size, us = line.split()
    runs[(kind, int(size))].append(float(us))
for size in sorted({s for _, s in runs}):
    pg, comm, gloo, mpi = (statistics.median(runs[(k, size)]) for k in ("pg", "comm", "gloo", "mpi"))
    print(f"{size} | {pg:.1f} {comm:.1f} {gloo:.1f} {mpi:.1f} | {pg / comm:.2f} | {gloo / pg:.2f} | {mpi / pg:.2f}")
PY
