#!/usr/bin/env bash
# DistributedDataParallel training throughput against PyTorch DDP (gloo, CPU)
# on Fashion-MNIST, run by run interleaved so that machine noise hits both
# alike; prints the median of each configuration and the ratios.
#
#   ddp/bench/compare_peers.sh [REPS] [STEPS] [-- extra ddp_bench flags]
#
# MLP_STEPS (environment) gives the MLP its own step count: its steps are
# ~8x shorter than the CNN's, and runs under a few seconds are dominated by
# start-up effects and noise.
#
# Needs: bazel build //examples:ddp_bench; /usr/bin/python3 with torch
# (python3-torch) and OpenBLAS; dataset-fashion-mnist.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPS=${1:-3}
STEPS=${2:-300}
shift 2 || true
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
PEER=/work/shared/peers/torch_ddp_train.py
BENCH=${DDP_BENCH:-bazel-bin/examples/ddp_bench}
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg); steps: cnn $STEPS, mlp ${MLP_STEPS:-$STEPS}; ddp_bench ${EXTRA[*]:-}"
for rep in $(seq "$REPS"); do
  for model in mlp cnn; do
    steps=$STEPS
    [ "$model" = mlp ] && steps=${MLP_STEPS:-$STEPS}
    for np in 1 2; do
      "$BENCH" --model="$model" --steps="$steps" --nproc_per_node="$np" --eval=false "${EXTRA[@]}" |
        awk '{print "ddp", $0}' >>"$OUT"
    done
    /usr/bin/python3 "$PEER" 2 "$model" "$steps" 2>/dev/null | awk '{print "torch", $0}' >>"$OUT"
    # The machine's own ceiling for 2 ranks: two independent 1-rank runs at
    # once (no communication at all); their summed samples/s.
    pair=$(mktemp)
    "$BENCH" --model="$model" --steps="$steps" --nproc_per_node=1 --eval=false "${EXTRA[@]}" >"$pair.a" &
    "$BENCH" --model="$model" --steps="$steps" --nproc_per_node=1 --eval=false "${EXTRA[@]}" >"$pair.b"
    wait
    cat "$pair.a" "$pair.b" | grep -v "^#" | awk -v m="$model" '{s += $3} END {print "pair", m, 2, s}' >>"$OUT"
    rm -f "$pair" "$pair.a" "$pair.b"
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
rate = collections.defaultdict(list)
extra = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    who, model, nproc, sps = f[0], f[1], int(f[2]), float(f[3])
    rate[(who, model, nproc)].append(sps)
    if who == "ddp" and len(f) >= 15:
        extra[(model, nproc)].append([float(x) for x in f[6:15]])
print("| model | ddp 1 rank | ddp 2 ranks | torch DDP 2 ranks | ddp 2 / torch 2 | ddp 2 / ddp 1 | two 1-rank runs at once | ddp 2 / that | comm ms | overlap | exposed ms | comm thread CPU ms | step ms | CPU ms |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for model in ("mlp", "cnn"):
    m = lambda who, n: statistics.median(rate[(who, model, n)]) if rate[(who, model, n)] else float("nan")
    d1, d2, t2, p2 = m("ddp", 1), m("ddp", 2), m("torch", 2), m("pair", 2)
    e = extra.get((model, 2), [])
    med = lambda k: statistics.median(x[k] for x in e) if e else float("nan")
    print(f"| {model} | {d1:.0f} | {d2:.0f} | {t2:.0f} | {d2 / t2:.2f}x | {d2 / d1:.2f}x | "
          f"{p2:.0f} ({p2 / d1:.2f}x) | {d2 / p2:.2f}x | "
          f"{med(2):.2f} | {med(3):.0f}% | {med(4):.2f} | {med(5):.2f} | {med(7):.2f} | {med(8):.2f} |")
print()
print("samples/s per run:")
for k in sorted(rate):
    print(" ", *k, " ".join(f"{v:.0f}" for v in rate[k]))
PY
