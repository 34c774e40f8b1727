# shellcheck shell=bash
# Sourced by the comparison scripts (transport/bench/compare_*.sh,
# netns_*.sh, ddp/bench/compare_p2p.sh, examples/nn_bench_vs_torch.sh) after
# they set SCRIPT (the name their messages start with) and USAGE (their
# usage line). Gives them one temporary folder, checks of their inputs and
# tools made before the first run, and runs whose failure says which command
# failed and what it printed on stderr (the runs' stderr was thrown away, so
# a failed peer or benchmark ended the script without a word).

# A count that is not a positive whole number gave an empty table and exit
# status 0 (REPS=0), or a failure deep in the runs (seq's or mpirun's
# message, or none): refused up front, naming it.
positive_int() {  # NAME VALUE
  [[ $2 =~ ^[1-9][0-9]*$ ]] && return 0
  echo "$SCRIPT: $1=$2: expected a positive whole number (usage: $USAGE)" >&2
  exit 2
}

# WORK: a fresh folder for every temporary file of this run (compiled
# peers, outputs, logs), so that two runs at once do not share names; it is
# removed on exit, on a failure as well. A script with more to undo calls
# bench_cleanup from its own EXIT trap instead.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/${SCRIPT%.sh}.XXXXXX")
# The run in progress (its timeout's pid), stopped on the way out: timeout
# puts it in a process group of its own, which the terminal's Ctrl-C does
# not reach.
RUN_PID=
bench_cleanup() {
  if [ -n "$RUN_PID" ]; then
    kill -TERM "$RUN_PID" 2>/dev/null || true
    wait "$RUN_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap bench_cleanup EXIT
# Ctrl-C and kill end the script through its EXIT trap.
trap 'exit 130' INT
trap 'exit 143' TERM

need_executable() {  # PATH HOW_TO_GET_IT
  [ -x "$1" ] || { echo "$SCRIPT: no $1; $2" >&2; exit 1; }
}

need_readable() {  # PATH HOW_TO_GET_IT
  [ -r "$1" ] || { echo "$SCRIPT: no $1; $2" >&2; exit 2; }
}

need_mpi() {
  command -v mpicc >/dev/null && command -v mpirun >/dev/null ||
    { echo "$SCRIPT: needs mpicc and mpirun (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; }
}

# TORCH_PYTHON overrides the Python that runs the PyTorch peers.
TORCH_PYTHON=${TORCH_PYTHON:-/usr/bin/python3}
need_torch() {
  "$TORCH_PYTHON" -c 'import torch' 2>/dev/null ||
    { echo "$SCRIPT: $TORCH_PYTHON cannot import torch (apt-get install python3-torch)" >&2; exit 1; }
}

# A deadline for every run (seconds; BENCH_RUN_TIMEOUT overrides it): a
# hung peer (an mpirun whose rank died, gloo's 30-minute default timeout)
# held the script forever. Our own runs have per-call deadlines already.
RUN_TIMEOUT=${BENCH_RUN_TIMEOUT:-1800}
positive_int BENCH_RUN_TIMEOUT "$RUN_TIMEOUT"

# run CMD...: runs CMD (VAR=value words first are its environment) with
# its stdout in $WORK/run.out and its stderr in $WORK/run.err, for at most
# RUN_TIMEOUT seconds (then SIGTERM, and SIGKILL 30 s later); when it
# fails, says which command failed, with its exit status and stderr, and
# ends the script with 1. Not inside a pipeline: a signal must find the
# run in this shell's RUN_PID. The run goes to the background and is waited
# for, because a trapped signal ends `wait` at once, where the shell would
# run the trap only after a foreground run ended.
run() {
  local status=0
  timeout --kill-after=30 "$RUN_TIMEOUT" env "$@" >"$WORK/run.out" 2>"$WORK/run.err" </dev/null &
  RUN_PID=$!
  wait "$RUN_PID" || status=$?
  RUN_PID=
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "$SCRIPT: this run ran past its ${RUN_TIMEOUT} s deadline (BENCH_RUN_TIMEOUT) and was stopped: $*" >&2
    echo "$SCRIPT: its stderr:" >&2
    cat "$WORK/run.err" >&2
    exit 1
  fi
  if [ "$status" -ne 0 ]; then
    echo "$SCRIPT: this run failed (exit $status): $*" >&2
    echo "$SCRIPT: its stderr:" >&2
    cat "$WORK/run.err" >&2
    exit 1
  fi
}

# rows: the last run's lines other than '#' comments; a run that printed
# none ends the script, saying so.
rows() {
  grep -v '^#' "$WORK/run.out" && return 0
  echo "$SCRIPT: a run printed no result rows; its output:" >&2
  cat "$WORK/run.out" "$WORK/run.err" >&2
  exit 1
}
