#!/usr/bin/env bash
# DistributedDataParallel training throughput against PyTorch DDP (gloo, CPU)
# on Fashion-MNIST, run by run interleaved so that machine noise hits both
# alike; prints the median of each configuration and the ratios.
#
#   ddp/bench/compare_peers.sh [REPS] [STEPS] [-- extra ddp_bench flags]
#
# The extra flags may not change the workload the PyTorch peer runs:
# --batch goes to the peer as well; --model, --steps, --nproc_per_node,
# --data_dir and --flush_denormal are refused.
#
# MLP_STEPS (environment) gives the MLP its own step count: its steps are
# ~8x shorter than the CNN's, and runs under a few seconds are dominated by
# start-up effects and noise.
#
# VARIANT (environment), e.g. VARIANT=--flush_denormal=true, adds ddp_bench
# runs of 1 and 2 ranks with those extra flags to every repetition, reported
# as the rows "<model> +variant".
#
# Needs: bazel build //examples:ddp_bench; /usr/bin/python3 with torch
# (python3-torch) and OpenBLAS; dataset-fashion-mnist.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPS=${1:-3}
STEPS=${2:-300}
# Only the arguments given (`shift 2` with one argument shifts nothing, and
# REPS became a ddp_bench flag).
shift $(($# < 2 ? $# : 2))
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
# A count that is not a positive whole number used to give a table of NaN
# (REPS=0) or a failure deep in the runs; refuse it up front, naming it.
positive_int() {
  [[ $2 =~ ^[1-9][0-9]*$ ]] && return 0
  echo "compare_peers: $1=$2: expected a positive whole number" \
    "(usage: compare_peers.sh [REPS] [STEPS] [-- ddp_bench flags])" >&2
  exit 2
}
positive_int REPS "$REPS"
positive_int STEPS "$STEPS"
[ -z "${MLP_STEPS+set}" ] || positive_int MLP_STEPS "$MLP_STEPS"
RUN_TIMEOUT=${BENCH_RUN_TIMEOUT:-1800}
positive_int BENCH_RUN_TIMEOUT "$RUN_TIMEOUT"
# The extra flags must leave the workload the peer runs alone, or the ratio
# compares different work (ddp_bench at --batch=128 against the peer at
# 64). --batch is passed on to the peer (its 4th argument); the flags the
# peer cannot follow (its model, steps, ranks and data are fixed, and it
# does not flush denormals) are refused. VARIANT adds ddp_bench-only rows
# (--flush_denormal is its use), but may not change the batch, model or data.
BATCH=64
workload_flags() {  # WHERE FLAGS...: sets BATCH; refuses what the peer cannot mirror
  local where=$1 name value
  shift
  while [ $# -gt 0 ]; do
    name=${1#-}
    name=${name#-}
    value=
    case "$name" in
      *=*) value=${name#*=} name=${name%%=*} ;;
      *) [ $# -gt 1 ] && [ "${2#-}" = "$2" ] && value=$2 ;;
    esac
    case "$name" in
      batch)
        [ "$where" = "extra" ] ||
          { echo "compare_peers: VARIANT: --batch is refused (the peer runs one batch size); give it after --" >&2; exit 2; }
        positive_int --batch "$value"
        BATCH=$value
        ;;
      model | steps | nproc_per_node | nproc-per-node | data_dir)
        echo "compare_peers: $where: --$name is refused: the PyTorch peer cannot run the same" \
          "(use REPS, STEPS and MLP_STEPS; the peer reads /usr/share/datasets/fashion-mnist)" >&2
        exit 2
        ;;
      flush_denormal)
        [ "$where" = "VARIANT" ] || {
          echo "compare_peers: $where: --flush_denormal is refused: the PyTorch peer does not flush denormals" \
            "(VARIANT=--flush_denormal=true adds it as rows of their own)" >&2
          exit 2
        }
        ;;
    esac
    shift
  done
}
workload_flags extra "${EXTRA[@]}"
# shellcheck disable=SC2086  # VARIANT holds flags, split on purpose
workload_flags VARIANT ${VARIANT:-}
# PEERS_DIR overrides where the peers are (../shared/peers next to the
# checkout, else /work/shared/peers).
PEERS=${PEERS_DIR:-}
if [ -z "$PEERS" ]; then
  PEERS=$(pwd)/../shared/peers
  [ -d "$PEERS" ] || PEERS=/work/shared/peers
fi
PEER=$PEERS/torch_ddp_train.py
[ -r "$PEER" ] || { echo "compare_peers: no $PEER; set PEERS_DIR to the peers' folder" >&2; exit 2; }
BENCH=${DDP_BENCH:-bazel-bin/examples/ddp_bench}
# The peer runs with its stderr hidden (PyTorch's warnings; shown if it fails); say up front
# what is missing instead of ending silently at its first run.
# TORCH_PYTHON overrides the Python that runs the peer.
TORCH_PYTHON=${TORCH_PYTHON:-/usr/bin/python3}
if ! "$TORCH_PYTHON" -c 'import torch' 2>/dev/null; then
  echo "compare_peers: $TORCH_PYTHON cannot import torch; install the peers with" \
    "'apt-get install python3-torch openmpi-bin'" >&2
  exit 1
fi
[ -x "$BENCH" ] || { echo "compare_peers: no ddp_bench at $BENCH; bazel build //examples:ddp_bench" >&2; exit 1; }
OUT=$(mktemp)
PEER_LOG=$(mktemp)
PEER_OUT=$(mktemp)
# The peer's or the pair's background run (bg) and the pair's files (pair)
# while they exist: a failing foreground run, a failed peer or Ctrl-C must
# not leave the run behind (a background job of a script ignores Ctrl-C) nor its files.
bg=
pair=
cleanup() {
  if [ -n "$bg" ] && kill -0 "$bg" 2>/dev/null; then
    kill "$bg" 2>/dev/null || true
    wait "$bg" 2>/dev/null || true
  fi
  rm -f "$OUT" "$PEER_LOG" "$PEER_OUT"
  [ -z "$pair" ] || rm -f "$pair" "$pair.a" "$pair.b"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "# $(date -u) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg); steps: cnn $STEPS, mlp ${MLP_STEPS:-$STEPS}; batch $BATCH per rank (both); ddp_bench ${EXTRA[*]:-}; variant: ${VARIANT:-none}"
# 2 ranks in lockstep on 2 cores pay for any other work on either core (an
# idle Bazel server takes about 2% of one; docs/benchmarks.md).
if pgrep -f 'bazel.*A-server.jar' >/dev/null 2>&1; then
  echo "# note: a Bazel server is running; 'bazel shutdown' before a run gives quieter 2-rank figures"
fi
for rep in $(seq "$REPS"); do
  for model in mlp cnn; do
    steps=$STEPS
    [ "$model" = mlp ] && steps=${MLP_STEPS:-$STEPS}
    for np in 1 2; do
      "$BENCH" --model="$model" --steps="$steps" --nproc_per_node="$np" --eval=false "${EXTRA[@]}" |
        awk '{print "ddp", $0}' >>"$OUT"
      if [ -n "${VARIANT:-}" ]; then
        # shellcheck disable=SC2086  # VARIANT holds flags, split on purpose
        "$BENCH" --model="$model" --steps="$steps" --nproc_per_node="$np" --eval=false "${EXTRA[@]}" $VARIANT |
          awk '{print "var", $0}' >>"$OUT"
      fi
    done
    # Its stderr (PyTorch's warnings) is shown only when it fails.
    # With a deadline (BENCH_RUN_TIMEOUT seconds, as the other comparison
    # scripts): a hung gloo peer waits out its 30-minute default timeout.
    # In the background and waited for, as the pair's run below: timeout
    # gives it a process group of its own, which Ctrl-C does not reach, and
    # the shell runs its trap (which stops it) only once `wait` returns.
    timeout --kill-after=30 "$RUN_TIMEOUT" "$TORCH_PYTHON" "$PEER" 2 "$model" "$steps" "$BATCH" \
      >"$PEER_OUT" 2>"$PEER_LOG" </dev/null &
    bg=$!
    status=0
    wait "$bg" || status=$?
    bg=
    if [ "$status" -ne 0 ]; then
      echo "compare_peers: the PyTorch peer failed or ran past ${RUN_TIMEOUT} s (exit $status; $PEER 2 $model $steps $BATCH, rep $rep of $REPS); its stderr:" >&2
      cat "$PEER_LOG" >&2
      exit 1
    fi
    awk '{print "torch", $0}' "$PEER_OUT" >>"$OUT"
    # The machine's own ceiling for 2 ranks: two independent 1-rank runs at
    # once (no communication at all); their summed samples/s.
    pair=$(mktemp)
    "$BENCH" --model="$model" --steps="$steps" --nproc_per_node=1 --eval=false "${EXTRA[@]}" >"$pair.a" &
    bg=$!
    "$BENCH" --model="$model" --steps="$steps" --nproc_per_node=1 --eval=false "${EXTRA[@]}" >"$pair.b"
    status=0
    wait "$bg" || status=$?
    bg=
    if [ "$status" -ne 0 ]; then
      echo "compare_peers: the background 1-rank $model run of the pair failed (exit $status, rep $rep of $REPS)" >&2
      exit 1
    fi
    # (grep finding no line must not end the script under pipefail)
    { grep -hv "^#" "$pair.a" "$pair.b" || true; } | awk -v m="$model" '{s += $3} END {print "pair", m, 2, s}' >>"$OUT"
    rm -f "$pair" "$pair.a" "$pair.b"
    pair=
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
    if who in ("ddp", "var") and len(f) >= 15:
        # The last field, rank 0's wait for the other ranks, is newer.
        extra[(who, model, nproc)].append([float(x) for x in f[6:16]] + [float("nan")] * (16 - len(f)))
print("| model | ddp 1 rank | ddp 2 ranks | torch DDP 2 ranks | ddp 2 / torch 2 | ddp 2 / ddp 1 | two 1-rank runs at once | ddp 2 / that | comm ms | overlap | exposed ms | comm thread CPU ms | step ms | CPU ms | rank 0 waits ms |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
rows = [(m, "ddp", m) for m in ("mlp", "cnn")]
if any(k[0] == "var" for k in rate):
    rows += [(m, "var", m + " +variant") for m in ("mlp", "cnn")]
for model, who, label in rows:
    m = lambda w, n: statistics.median(rate[(w, model, n)]) if rate[(w, model, n)] else float("nan")
    d1, d2, t2, p2 = m(who, 1), m(who, 2), m("torch", 2), m("pair", 2)
    e = extra.get((who, model, 2), [])
    med = lambda k: statistics.median(x[k] for x in e) if e else float("nan")
    # The pair ceiling is measured without the variant's flags.
    print(f"| {label} | {d1:.0f} | {d2:.0f} | {t2:.0f} | {d2 / t2:.2f}x | {d2 / d1:.2f}x | "
          f"{p2:.0f} ({p2 / d1:.2f}x) | {d2 / p2:.2f}x | "
          f"{med(2):.2f} | {med(3):.0f}% | {med(4):.2f} | {med(5):.2f} | {med(7):.2f} | {med(8):.2f} | "
          f"{med(9):.2f} |")
print()
print("samples/s per run:")
for k in sorted(rate):
    print(" ", *k, " ".join(f"{v:.0f}" for v in rate[k]))
PY
