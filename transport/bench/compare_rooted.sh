#!/usr/bin/env bash
# Reduce, gather and scatter side by side: this project's Communicator
# (allreduce_bench --collective=..., through the shared-memory engine, and
# over UCX with DDP_SHARED_MEMORY=0) against Open MPI's MPI_Reduce,
# MPI_Gather and MPI_Scatter over UCX, f32, root 0, out of place,
# interleaved run by run; prints the median time per size and the ratios.
# Then, over UCX only, the reduce's binomial tree against its ring
# (reduce-scatter, then blocks to the root): where the switch belongs.
#
#   transport/bench/compare_rooted.sh [REPS] [NPROC...]
#
# Sizes: the reduce's vector; the root's whole gather/scatter buffer
# (size() blocks). Needs: bazel build //examples:allreduce_bench;
# mpicc/mpirun (openmpi-bin, libopenmpi-dev).
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=compare_rooted USAGE="compare_rooted.sh [REPS] [NPROC...]"
source transport/bench/bench_common.sh
REPS=${1:-3}
shift || true
if [ $# -gt 0 ]; then NPROCS=("$@"); else NPROCS=(2 4); fi
positive_int REPS "$REPS"
for np in "${NPROCS[@]}"; do positive_int NPROC "$np"; done
SIZES="4096 65536 1048576 16777216"
BENCH=bazel-bin/examples/allreduce_bench
need_executable "$BENCH" "bazel build //examples:allreduce_bench"
need_mpi
OUT=$WORK/runs
SWITCH=$WORK/switch
run mpicc -O2 -o "$WORK/mpi_rooted" transport/bench/mpi_rooted.c
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
# --check in our runs: one more call per size after the timed ones, not
# timed; a wrong element fails the script.
ours() {  # np collective [env...]: one run, its rows read by rows
  local np=$1 collective=$2
  shift 2
  run "$@" "$BENCH" --nproc_per_node="$np" --collective="$collective" --in_place=false \
    --min_bytes=4096 --max_bytes=16M --step_factor=16 --check
}
for rep in $(seq "$REPS"); do
  for np in "${NPROCS[@]}"; do
    for c in reduce gather scatter; do
      run mpirun --allow-run-as-root --oversubscribe --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any -np "$np" "$WORK/mpi_rooted" "$c" $SIZES
      rows | awk -v np="$np" -v c="$c" '{print np, c, "openmpi_ucx", $1, $2}' >>"$OUT"
      ours "$np" "$c"
      rows | awk -v np="$np" -v c="$c" '{print np, c, "ddp_shm", $1, $4}' >>"$OUT"
      ours "$np" "$c" DDP_SHARED_MEMORY=0
      rows | awk -v np="$np" -v c="$c" '{print np, c, "ddp_ucx", $1, $4}' >>"$OUT"
    done
    for algo in tree ring; do
      run DDP_SHARED_MEMORY=0 "$BENCH" --nproc_per_node="$np" --collective=reduce --algo="$algo" \
        --in_place=false --min_bytes=4096 --max_bytes=16M --step_factor=4 --check
      rows | awk -v np="$np" -v a="$algo" '{print np, a, $1, $4}' >>"$SWITCH"
    done
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" "$SWITCH" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    np, c, who, size, us = line.split()
    # Sizes round down to whole blocks differently per tool: key by the
    # nearest power of two.
    n = int(size)
    key = 1 << (n - 1).bit_length() if n & (n - 1) else n
    runs[(int(np), c, who, key)].append(float(us))
for c in ("reduce", "gather", "scatter"):
    for np in sorted({k[0] for k in runs}):
        print(f"\n## {c}, {np} ranks: median time_us over runs")
        print("| bytes | ddp (shm) | ddp (UCX) | Open MPI (UCX) | Open MPI / ddp shm | Open MPI / ddp UCX |")
        print("| --- | --- | --- | --- | --- | --- |")
        for size in sorted({k[3] for k in runs if k[0] == np and k[1] == c}):
            m = {w: statistics.median(runs[(np, c, w, size)])
                 for w in ("ddp_shm", "ddp_ucx", "openmpi_ucx") if runs.get((np, c, w, size))}
            cell = lambda w: f"{m[w]:.1f}" if w in m else "-"
            ratio = lambda w: f"{m['openmpi_ucx'] / m[w]:.2f}x" if w in m and "openmpi_ucx" in m else "-"
            print(f"| {size} | {cell('ddp_shm')} | {cell('ddp_ucx')} | {cell('openmpi_ucx')} | "
                  f"{ratio('ddp_shm')} | {ratio('ddp_ucx')} |")
switch = collections.defaultdict(list)
for line in open(sys.argv[2]):
    np, algo, size, us = line.split()
    switch[(int(np), algo, int(size))].append(float(us))
for np in sorted({k[0] for k in switch}):
    print(f"\n## reduce over UCX, {np} ranks: tree against ring, median time_us")
    print("| bytes | tree | ring | ring / tree |")
    print("| --- | --- | --- | --- |")
    for size in sorted({k[2] for k in switch if k[0] == np}):
        t = statistics.median(switch[(np, "tree", size)]) if switch.get((np, "tree", size)) else None
        r = statistics.median(switch[(np, "ring", size)]) if switch.get((np, "ring", size)) else None
        print(f"| {size} | {t if t is None else f'{t:.1f}'} | {r if r is None else f'{r:.1f}'} | "
              f"{f'{r / t:.2f}' if t and r else '-'} |")
PY
