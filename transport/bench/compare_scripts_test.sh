#!/usr/bin/env bash
# The comparison scripts (transport/bench/compare_*.sh and netns_*.sh,
# ddp/bench/compare_p2p.sh and compare_peers.sh, examples/nn_bench_vs_torch.sh)
# without their peers: each runs from a copy of the checkout's layout with
# fake mpicc, mpirun and Python on the PATH and a fake or the real
# allreduce_bench under bazel-bin. Checked: counts that are not positive
# whole numbers are refused naming them; a missing tool or peer is named
# before the first run; a failed run says which command failed and shows its
# stderr; our runs pass --check, and a wrong element fails the script; the
# temporary files live under one folder of TMPDIR that is gone afterwards.
set -uo pipefail
RUNFILES=${TEST_SRCDIR:?}/${TEST_WORKSPACE:?}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

REPO=$TEST_TMPDIR/repo
FAKES=$TEST_TMPDIR/fakes
export TMPDIR=$TEST_TMPDIR/tmp
mkdir -p "$REPO/transport/bench" "$REPO/ddp/bench" "$REPO/examples" "$REPO/bazel-bin/examples" \
  "$REPO/bazel-bin/ddp" "$FAKES" "$TMPDIR"
(cd "$RUNFILES" && for f in transport/bench/*.sh transport/bench/*.c transport/bench/*.py \
  ddp/bench/compare_p2p.sh ddp/bench/compare_peers.sh ddp/bench/mpi_p2p.c ddp/bench/torch_gloo_p2p.py \
  examples/nn_bench_vs_torch.sh; do cp -L "$f" "$REPO/$f"; done)
REAL_BENCH=$RUNFILES/examples/allreduce_bench

# Fakes. mpicc writes an empty program where -o says and logs that path;
# mpirun and the Python print one result row (the fields every script
# reads); the Python imports anything (-c).
cat >"$FAKES/mpicc" <<'SH'
#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
printf '#!/bin/sh\n' >"$out" && chmod +x "$out" && echo "$out" >>"$TEST_TMPDIR/mpicc.log"
SH
cat >"$FAKES/mpirun" <<'SH'
#!/bin/sh
echo "4096 10.0 0.4 0.8"
SH
cat >"$FAKES/python" <<'SH'
#!/bin/sh
[ "$1" = -c ] && exit 0
case "$1" in *torch_ddp_train.py) [ -z "${FAKE_PEER_HANG:-}" ] || { echo $$ >"$TEST_TMPDIR/hung.pid"; exec sleep 600; }; echo "$3 $2 12345 1 1"; echo "$*" >>"$TEST_TMPDIR/peer.log"; exit 0 ;; esac
echo "4096 10.0 0.4 0.8"
SH
# A fake allreduce_bench (and p2p_bench): fails, naming the
# reason on stderr, unless it was given --check; else prints a header and
# one row. FAKE_BENCH_FAIL makes it fail with that text; FAKE_BENCH_NO_ROWS
# print the header alone; FAKE_BENCH_HANG hang.
cat >"$FAKES/bench" <<'SH'
#!/bin/sh
echo "$*" >>"$TEST_TMPDIR/bench.log"
[ -z "${FAKE_BENCH_FAIL:-}" ] || { echo "$FAKE_BENCH_FAIL" >&2; exit 2; }
# A hung run: only the script's deadline ends it.
[ -z "${FAKE_BENCH_HANG:-}" ] || { echo $$ >"$TEST_TMPDIR/hung.pid"; exec sleep 600; }
case " $* " in *" --check "*) ;; *) echo "fake bench: called without --check" >&2; exit 3 ;; esac
echo "# fake"
[ -z "${FAKE_BENCH_NO_ROWS:-}" ] || exit 0
echo "        4096         1024   ring      10.00      0.400      0.400      0"
SH
# A fake ddp_bench: one result line for its --model and --nproc_per_node.
cat >"$FAKES/ddp_bench" <<'SH'
#!/bin/sh
for a in "$@"; do
  case "$a" in --model=*) model=${a#--model=} ;; --nproc_per_node=*) np=${a#--nproc_per_node=} ;; esac
done
echo "$model $np 1000 1 1"
SH
chmod +x "$FAKES"/*
export PATH=$FAKES:$PATH TORCH_PYTHON=$FAKES/python
mkdir -p "$TEST_TMPDIR/peers"
touch "$TEST_TMPDIR/peers/mpi_allreduce.c" "$TEST_TMPDIR/peers/torch_gloo_allreduce.py" \
  "$TEST_TMPDIR/peers/torch_ddp_train.py"
export PEERS_DIR=$TEST_TMPDIR/peers

# expect NAME RC NEEDLE SCRIPT ARGS...: runs SCRIPT (relative to the copy)
# and checks its exit status, that its stderr holds NEEDLE and that it left
# nothing in TMPDIR.
expect() {
  local name=$1 rc=$2 needle=$3 script=$4 out got
  shift 4
  out=$("$REPO/$script" "$@" 2>&1 >/dev/null)
  got=$?
  [ "$got" = "$rc" ] || fail "$name: $script $*: exit $got, expected $rc; stderr: $out"
  grep -qF -- "$needle" <<<"$out" || fail "$name: $script $*: expected \`$needle\` in stderr: $out"
  local left
  left=$(ls -A "$TMPDIR")
  [ -z "$left" ] || { fail "$name: $script left $left in TMPDIR"; rm -rf "${TMPDIR:?}"/*; }
}

COMPARE=(transport/bench/compare_peers.sh transport/bench/compare_algorithms.sh
  transport/bench/compare_alltoall.sh transport/bench/compare_rooted.sh)

# Counts: REPS (every script) and NPROC.
for s in "${COMPARE[@]}" transport/bench/compare_hierarchical.sh ddp/bench/compare_p2p.sh \
  transport/bench/netns_hierarchical.sh transport/bench/netns_vs_mpi.sh; do
  for bad in 0 abc -1 1.5; do
    expect "REPS=$bad" 2 "REPS=$bad: expected a positive whole number" "$s" "$bad"
  done
done
for s in "${COMPARE[@]}"; do
  expect "NPROC=0" 2 "NPROC=0: expected a positive whole number" "$s" 1 2 0
done
expect "NPROC=x" 2 "NPROC=x: expected a positive whole number" transport/bench/netns_vs_mpi.sh 1 x
expect "STEPS=0" 2 "STEPS=0: expected a positive whole number" examples/nn_bench_vs_torch.sh 0
expect "REPEATS=0" 2 "REPEATS=0: expected a positive whole number" examples/nn_bench_vs_torch.sh 10 0
expect "MODELS" 2 "unknown model 'cnn2'" examples/nn_bench_vs_torch.sh 10 1 "mlp cnn2"

# A missing allreduce_bench is named before the first run.
for s in "${COMPARE[@]}" transport/bench/compare_hierarchical.sh; do
  expect "no bench" 1 "no bazel-bin/examples/allreduce_bench; bazel build //examples:allreduce_bench" "$s" 1 2
done
# A missing peer is named (compare_peers checked the MPI one only).
rm "$PEERS_DIR/torch_gloo_allreduce.py"
ln -s "$FAKES/bench" "$REPO/bazel-bin/examples/allreduce_bench"
expect "no gloo peer" 2 "torch_gloo_allreduce.py; set PEERS_DIR" transport/bench/compare_peers.sh 1 2
touch "$PEERS_DIR/torch_gloo_allreduce.py"

# Every run of ours passes --check (the fake fails without it), and the
# scripts end with a table.
ln -s "$FAKES/bench" "$REPO/bazel-bin/ddp/p2p_bench"
for s in "${COMPARE[@]}" transport/bench/compare_hierarchical.sh; do
  : >"$TEST_TMPDIR/mpicc.log"
  expect "runs pass --check" 0 "" "$s" 1 2
  # The compiled peer goes under the run's own folder of TMPDIR, not a
  # fixed /tmp name that a second run at once would share.
  while read -r built; do
    [ "${built#"$TMPDIR"/}" != "$built" ] || fail "$s: compiled its peer to $built, outside TMPDIR"
  done <"$TEST_TMPDIR/mpicc.log"
done

# A failed run says which command failed and shows its stderr (it went to
# /dev/null, and the script ended without a word).
for s in "${COMPARE[@]}" transport/bench/compare_hierarchical.sh ddp/bench/compare_p2p.sh; do
  FAKE_BENCH_FAIL="allreduce_bench: fake refusal" \
    expect "failed run" 1 "allreduce_bench: fake refusal" "$s" 1
  FAKE_BENCH_FAIL="allreduce_bench: fake refusal" \
    expect "failed run" 1 "failed (exit 2): " "$s" 1
done

# A run that prints no result rows is named too (a bare grep -v ended the
# script without a word).
for s in "${COMPARE[@]}" transport/bench/compare_hierarchical.sh; do
  FAKE_BENCH_NO_ROWS=1 expect "no rows" 1 "a run printed no result rows" "$s" 1 2
done

# A hung run is stopped at the deadline, and said so (it held the script
# forever).
for s in transport/bench/compare_algorithms.sh ddp/bench/compare_p2p.sh; do
  started=$SECONDS
  FAKE_BENCH_HANG=1 BENCH_RUN_TIMEOUT=2 expect "hung run" 1 "ran past its 2 s deadline" "$s" 1
  [ $((SECONDS - started)) -lt 60 ] || fail "$s: the hung run was stopped after $((SECONDS - started)) s"
done
BENCH_RUN_TIMEOUT=0 expect "BENCH_RUN_TIMEOUT=0" 2 "BENCH_RUN_TIMEOUT=0: expected a positive whole number" \
  transport/bench/compare_algorithms.sh 1

# Stopped (SIGTERM; Ctrl-C takes the same path) during a run, a script
# ends at once and stops the run (the shell ran its trap only once the run
# ended, and the run, in the process group timeout makes, went on).
ln -s "$FAKES/ddp_bench" "$REPO/bazel-bin/examples/ddp_bench"
for s in transport/bench/compare_algorithms.sh transport/bench/compare_rooted.sh ddp/bench/compare_peers.sh; do
  rm -f "$TEST_TMPDIR/hung.pid"
  FAKE_BENCH_HANG=1 FAKE_PEER_HANG=1 "$REPO/$s" 1 2 >/dev/null 2>&1 &
  script_pid=$!
  for _ in $(seq 300); do [ -s "$TEST_TMPDIR/hung.pid" ] && break; sleep 0.1; done
  if [ ! -s "$TEST_TMPDIR/hung.pid" ]; then
    fail "$s: the run never started"
    kill -KILL "$script_pid"
    continue
  fi
  kill -TERM "$script_pid"
  for _ in $(seq 100); do kill -0 "$script_pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$script_pid" 2>/dev/null; then
    fail "$s: still running 10 s after SIGTERM"
    kill -KILL "$script_pid"
  fi
  wait "$script_pid"
  [ $? = 143 ] || fail "$s: exit status after SIGTERM was not 143"
  hung=$(cat "$TEST_TMPDIR/hung.pid")
  for _ in $(seq 100); do kill -0 "$hung" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$hung" 2>/dev/null; then
    fail "$s: its run (pid $hung) outlived it"
    kill -KILL "$hung"
  fi
  [ -z "$(ls -A "$TMPDIR")" ] || { fail "$s: left $(ls -A "$TMPDIR") in TMPDIR"; rm -rf "${TMPDIR:?}"/*; }
done

# The real allreduce_bench with one element of each result spoilt: the
# comparison fails instead of printing a table.
rm "$REPO/bazel-bin/examples/allreduce_bench"
ln -s "$REAL_BENCH" "$REPO/bazel-bin/examples/allreduce_bench"
ALLREDUCE_BENCH_TEST_CORRUPT=1 expect "wrong results" 1 "--check found" transport/bench/compare_algorithms.sh 1 2

# ddp/bench/compare_peers.sh: --batch goes to the peer too; flags the peer
# cannot follow are refused.
DDP=ddp/bench/compare_peers.sh
for flag in --model=cnn --data_dir=/tmp --flush_denormal=true --nproc_per_node=4 "--steps 5"; do
  # shellcheck disable=SC2086  # "--steps 5" is two words on purpose
  expect "refused $flag" 2 "is refused" "$DDP" 1 5 -- $flag
done
VARIANT=--batch=32 expect "VARIANT --batch" 2 "VARIANT: --batch is refused" "$DDP" 1 5
expect "--batch=abc" 2 "--batch=abc: expected a positive whole number" "$DDP" 1 5 -- --batch=abc
for batch in --batch=128 "--batch 128"; do
  : >"$TEST_TMPDIR/peer.log"
  # shellcheck disable=SC2086  # "--batch 128" is two words on purpose
  expect "$batch" 0 "" "$DDP" 1 5 -- $batch
  [ "$(sort -u "$TEST_TMPDIR/peer.log")" = "$PEERS_DIR/torch_ddp_train.py 2 cnn 5 128
$PEERS_DIR/torch_ddp_train.py 2 mlp 5 128" ] || fail "$batch: the peer ran as: $(cat "$TEST_TMPDIR/peer.log")"
done

started=$SECONDS
FAKE_PEER_HANG=1 BENCH_RUN_TIMEOUT=2 expect "hung peer" 1 "the PyTorch peer failed or ran past 2 s" "$DDP" 1 5
[ $((SECONDS - started)) -lt 60 ] || fail "$DDP: the hung peer was stopped after $((SECONDS - started)) s"

[ "$failures" = 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all passed"
