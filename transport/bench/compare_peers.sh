#!/usr/bin/env bash
# Side-by-side all-reduce figures: this project's allreduce_bench against
# Open MPI over UCX and PyTorch gloo, f32 sum, interleaved run by run so that
# machine noise hits everyone alike; prints the median time per size.
#
#   transport/bench/compare_peers.sh [REPS] [NPROC...]
#
# Needs: bazel build //examples:allreduce_bench; mpicc/mpirun (openmpi-bin,
# libopenmpi-dev); /usr/bin/python3 (or $TORCH_PYTHON) with torch
# (python3-torch). Our runs pass --check (a wrong element fails the script).
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=compare_peers USAGE="compare_peers.sh [REPS] [NPROC...]"
source transport/bench/bench_common.sh
REPS=${1:-5}
shift || true
if [ $# -gt 0 ]; then NPROCS=("$@"); else NPROCS=(2 4); fi
positive_int REPS "$REPS"
for np in "${NPROCS[@]}"; do positive_int NPROC "$np"; done
SIZES="4096 65536 1048576 16777216 67108864"
# PEERS_DIR overrides where the peers are (../shared/peers next to the
# checkout, else /work/shared/peers).
PEERS=${PEERS_DIR:-}
if [ -z "$PEERS" ]; then
  PEERS=$(pwd)/../shared/peers
  [ -d "$PEERS" ] || PEERS=/work/shared/peers
fi
# What is missing, said before the first run.
for peer in mpi_allreduce.c torch_gloo_allreduce.py; do
  need_readable "$PEERS/$peer" "set PEERS_DIR to the peers' folder"
done
BENCH=bazel-bin/examples/allreduce_bench
need_executable "$BENCH" "bazel build //examples:allreduce_bench"
need_mpi
need_torch
OUT=$WORK/runs
run mpicc -O2 -o "$WORK/mpi_allreduce" "$PEERS/mpi_allreduce.c"
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$REPS"); do
  for np in "${NPROCS[@]}"; do
    run mpirun --allow-run-as-root --oversubscribe --mca pml ucx --mca pml_ucx_tls any \
      --mca pml_ucx_devices any -np "$np" "$WORK/mpi_allreduce" $SIZES
    rows | awk -v np="$np" '{print np, "openmpi_ucx", $1, $4}' >>"$OUT"
    # Like the MPI peer: 4 KiB to 16 MiB in one job, then 64 MiB, and rank
    # 0's own time, which is what both peers print. --check verifies one
    # more call after each size's timed ones (not timed) and fails the run
    # on any wrong element.
    for range in "4096 16M" "64M 64M"; do
      set -- $range
      run "$BENCH" --nproc_per_node="$np" --min_bytes="$1" --max_bytes="$2" --step_factor=16 --check \
        --time_of=rank0
      rows | awk -v np="$np" '{print np, "ddp_" $3, $1, $4}' >>"$OUT"
    done
    if [ "$np" = 2 ]; then
      run "$TORCH_PYTHON" "$PEERS/torch_gloo_allreduce.py" "$np" $SIZES
      rows | awk -v np="$np" '{print np, "gloo", $1, $4}' >>"$OUT"
    fi
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    np, who, size, us = line.split()
    runs[(int(np), who, int(size))].append(float(us))
for np in sorted({k[0] for k in runs}):
    who_all = sorted({k[1] for k in runs if k[0] == np})
    print(f"\n## {np} ranks: median time_us (busbw GB/s) over runs")
    print("| bytes | " + " | ".join(who_all) + " | ddp / openmpi busbw |")
    print("| --- |" + " --- |" * (len(who_all) + 1))
    for size in sorted({k[2] for k in runs if k[0] == np}):
        cells, ours, mpi = [], None, None
        for who in who_all:
            t = runs.get((np, who, size))
            if not t:
                cells.append("-"); continue
            m = statistics.median(t)
            bus = size / m / 1e3 * 2 * (np - 1) / np
            cells.append(f"{m:.1f} ({bus:.2f})")
            if who.startswith("ddp_"): ours = bus
            if who == "openmpi_ucx": mpi = bus
        ratio = f"{ours / mpi:.2f}x" if ours and mpi else "-"
        print(f"| {size} | " + " | ".join(cells) + f" | {ratio} |")
PY
