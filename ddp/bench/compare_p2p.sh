#!/usr/bin/env bash
# Point-to-point ping-pong between 2 ranks: ProcessGroup::Send/Recv, the
# Communicator::Send/Recv underneath it, PyTorch gloo's send/recv and Open
# MPI's MPI_Send/MPI_Recv over UCX, run by run interleaved; prints the median
# one-way time per size and the ratios (peer time / ours: how many times
# faster we are; pg / comm: what the process group adds to the transport).
#
#   ddp/bench/compare_p2p.sh [REPS]
#
# Needs: bazel build //ddp:p2p_bench; /usr/bin/python3 (or $TORCH_PYTHON)
# with torch; mpicc
# and mpirun (openmpi-bin, libopenmpi-dev).
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=compare_p2p USAGE="compare_p2p.sh [REPS]"
source transport/bench/bench_common.sh
REPS=${1:-5}
positive_int REPS "$REPS"
BENCH=${P2P_BENCH:-bazel-bin/ddp/p2p_bench}
OUT=$WORK/runs
MPI=$WORK/mpi_p2p
# What is missing, said before the first run.
need_executable "$BENCH" "bazel build //ddp:p2p_bench"
need_torch
need_mpi
run mpicc -O2 -o "$MPI" ddp/bench/mpi_p2p.c
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg); $REPS runs each"
for _ in $(seq "$REPS"); do
  run "$BENCH" --nproc_per_node=2 --mode=comm
  rows | awk '{print "comm", $1, $2}' >>"$OUT"
  run "$BENCH" --nproc_per_node=2 --mode=pg
  rows | awk '{print "pg", $1, $2}' >>"$OUT"
  run "$TORCH_PYTHON" ddp/bench/torch_gloo_p2p.py
  rows | awk '{print "gloo", $1, $2}' >>"$OUT"
  run mpirun --allow-run-as-root --oversubscribe --mca pml ucx --mca pml_ucx_tls any \
    --mca pml_ucx_devices any -np 2 "$MPI"
  rows | awk '{print "mpi", $1, $2}' >>"$OUT"
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
