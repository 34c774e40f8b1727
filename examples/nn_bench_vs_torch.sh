#!/usr/bin/env bash
# nn (//examples:nn_bench) against PyTorch (../shared/peers/torch_ddp_train.py)
# on one rank, one thread, batch 64, in one run: alternating runs of each, so
# that both see the same machine load. Prints one line per run and a table
# of medians with ratios (samples/s: nn / torch; peak RSS: nn / torch).
#
# Usage: examples/nn_bench_vs_torch.sh [STEPS=300] [REPEATS=3] [MODELS="mlp cnn"]
# PEERS_DIR overrides the peers' directory (default ../shared/peers next to
# the checkout, else /work/shared/peers).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=nn_bench_vs_torch USAGE='nn_bench_vs_torch.sh [STEPS=300] [REPEATS=3] [MODELS="mlp cnn"]'
source transport/bench/bench_common.sh
steps=${1:-300}
repeats=${2:-3}
models=${3:-"mlp cnn"}
positive_int STEPS "$steps"
positive_int REPEATS "$repeats"
# Checked before the first run: the PyTorch peer trains its CNN under any
# other name, and nn_bench refused the name only after that run.
for model in $models; do
  case "$model" in
    mlp | cnn) ;;
    *) echo "$SCRIPT: MODELS: unknown model '$model'; expected mlp or cnn (usage: $USAGE)" >&2; exit 2 ;;
  esac
done
[ -n "${models// /}" ] || { echo "$SCRIPT: MODELS is empty; expected mlp, cnn or both" >&2; exit 2; }
peers=${PEERS_DIR:-}
if [ -z "$peers" ]; then
  peers=$(pwd)/../shared/peers
  [ -d "$peers" ] || peers=/work/shared/peers
fi
bazel build -c opt //examples:nn_bench >/dev/null 2>&1 || bazel build -c opt //examples:nn_bench
bench=bazel-bin/examples/nn_bench
tmp=$WORK

# measure CMD...: prints "samples_per_s peak_rss_mb" of one run.
measure() {
  local log="$tmp/log"
  /usr/bin/time -v "$@" >"$log" 2>&1 || { cat "$log" >&2; return 1; }
  local sps rss
  sps=$(awk 'NF >= 3 && ($1 == "mlp" || $1 == "cnn") {print $3}' "$log" | tail -1)
  rss=$(awk -F: '/Maximum resident set size/ {print $2 / 1024}' "$log")
  echo "$sps $rss"
}

median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for model in $models; do
  : >"$tmp/$model.torch"
  : >"$tmp/$model.nn"
  for ((r = 1; r <= repeats; r++)); do
    t=$(OPENBLAS_NUM_THREADS=1 measure "$TORCH_PYTHON" "$peers/torch_ddp_train.py" 1 "$model" "$steps")
    n=$(measure "$bench" --model="$model" --steps="$steps")
    echo "$model run $r: torch $t | nn $n   (samples/s, peak RSS MB)"
    echo "$t" >>"$tmp/$model.torch"
    echo "$n" >>"$tmp/$model.nn"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
# The PyTorch peer wraps its model in DistributedDataParallel even on one
# rank (a gloo group, bucket copies and hooks every step); nn_bench trains
# the bare model: the header says so.
echo "| model | PyTorch DDP (1 rank) samples/s | nn samples/s | ratio | PyTorch peak RSS MB | nn peak RSS MB | RSS ratio |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for model in $models; do
  ts=$(cut -d' ' -f1 "$tmp/$model.torch" | median)
  ns=$(cut -d' ' -f1 "$tmp/$model.nn" | median)
  tr=$(cut -d' ' -f2 "$tmp/$model.torch" | median)
  nr=$(cut -d' ' -f2 "$tmp/$model.nn" | median)
  awk -v m="$model" -v ts="$ts" -v ns="$ns" -v tr="$tr" -v nr="$nr" \
    'BEGIN {printf "| %s | %.0f | %.0f | %.2fx | %.0f | %.0f | %.2f |\n", m, ts, ns, ns / ts, tr, nr, nr / tr}'
done
