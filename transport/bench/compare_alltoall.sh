#!/usr/bin/env bash
# All-to-all side by side: this project's Communicator::AllToAll
# (allreduce_bench --collective=alltoall) against Open MPI's MPI_Alltoall
# over UCX and PyTorch gloo's all_to_all_single, f32, interleaved run by run;
# prints the median time per size and our speed relative to each peer.
#
#   transport/bench/compare_alltoall.sh [REPS] [NPROC...]
#
# Sizes are each rank's whole send buffer (size() blocks), as nccl-tests
# counts them. Needs: bazel build //examples:allreduce_bench; mpicc/mpirun
# (openmpi-bin, libopenmpi-dev); /usr/bin/python3 (or $TORCH_PYTHON) with
# torch. Our runs pass --check: a wrong element fails the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCRIPT=compare_alltoall USAGE="compare_alltoall.sh [REPS] [NPROC...]"
source transport/bench/bench_common.sh
REPS=${1:-5}
shift || true
if [ $# -gt 0 ]; then NPROCS=("$@"); else NPROCS=(2 4); fi
positive_int REPS "$REPS"
for np in "${NPROCS[@]}"; do positive_int NPROC "$np"; done
SIZES="4096 65536 1048576 16777216"
BENCH=bazel-bin/examples/allreduce_bench
need_executable "$BENCH" "bazel build //examples:allreduce_bench"
need_mpi
need_torch
OUT=$WORK/runs
run mpicc -O2 -o "$WORK/mpi_alltoall" transport/bench/mpi_alltoall.c
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$REPS"); do
  for np in "${NPROCS[@]}"; do
    run mpirun --allow-run-as-root --oversubscribe --mca pml ucx --mca pml_ucx_tls any \
      --mca pml_ucx_devices any -np "$np" "$WORK/mpi_alltoall" $SIZES
    rows | awk -v np="$np" '{print np, "openmpi_ucx", $1, $2}' >>"$OUT"
    # --check: one more call per size after the timed ones, not timed.
    run "$BENCH" --nproc_per_node="$np" --collective=alltoall --min_bytes=4096 --max_bytes=16M \
      --step_factor=16 --check
    rows | awk -v np="$np" '{print np, "ddp", $1, $4}' >>"$OUT"
    run "$TORCH_PYTHON" transport/bench/torch_gloo_alltoall.py "$np" $SIZES
    rows | awk -v np="$np" '{print np, "gloo", $1, $2}' >>"$OUT"
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    np, who, size, us = line.split()
    # Sizes round down to whole blocks differently per tool: key by the
    # nearest power of two.
    key = 1 << (int(size) - 1).bit_length() if int(size) & (int(size) - 1) else int(size)
    runs[(int(np), who, key)].append(float(us))
for np in sorted({k[0] for k in runs}):
    print(f"\n## {np} ranks: median time_us per all-to-all over runs")
    print("| bytes per rank | ddp | Open MPI (UCX) | gloo | ddp vs Open MPI | ddp vs gloo |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in sorted({k[2] for k in runs if k[0] == np}):
        m = {w: statistics.median(runs[(np, w, size)]) for w in ("ddp", "openmpi_ucx", "gloo")
             if runs.get((np, w, size))}
        cell = lambda w: f"{m[w]:.1f}" if w in m else "-"
        ratio = lambda w: f"{m[w] / m['ddp']:.2f}x" if w in m and "ddp" in m else "-"
        print(f"| {size} | {cell('ddp')} | {cell('openmpi_ucx')} | {cell('gloo')} | "
              f"{ratio('openmpi_ucx')} | {ratio('gloo')} |")
PY
