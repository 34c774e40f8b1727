#!/usr/bin/env bash
# What tools/gpu_check.sh does without a GPU: argument errors, the table it
# prints from BENCH lines (a fixture log: inputs for the parser, not
# measurements), the order of its phases in a dry run, and a dry run stopped
# by SIGTERM in the middle of a benchmark.
# shellcheck disable=SC2016  # backquotes in the expected messages are literal
set -uo pipefail
# Bazel sets it; run by hand (the GPU machine), a folder of its own.
TEST_TMPDIR="${TEST_TMPDIR:-$(mktemp -d)}"
SCRIPT="$(dirname "$0")/gpu_check.sh"
FIXTURE="$(dirname "$0")/testdata/gpu_check_bench.log"
failures=0

check() {  # check NAME HAYSTACK NEEDLE
  if ! grep -qF -- "$3" <<<"$2"; then
    echo "FAIL: $1: expected to find \`$3\` in:"
    echo "$2"
    failures=$((failures + 1))
  fi
}

gone_within() {  # gone_within TENTHS_OF_A_SECOND PID: whether PID ends in time
  for _ in $(seq "$1"); do
    kill -0 "$2" 2>/dev/null || return 0
    sleep 0.1
  done
  ! kill -0 "$2" 2>/dev/null
}

expect_error() {  # expect_error MESSAGE ARGS...
  local msg=$1 out rc
  shift
  out="$("$SCRIPT" "$@" 2>&1)"
  rc=$?
  [ "$rc" = 2 ] || { echo "FAIL: $* exited $rc, expected 2"; failures=$((failures + 1)); }
  check "$*" "$out" "$msg"
}

expect_error 'unknown argument `--bogus`' --bogus
expect_error '--steps must be a positive integer, got `0`' --steps=0
expect_error '--batch must be a positive integer, got `x`' --batch=x
expect_error '--warmup must be a non-negative integer, got `-1`' --warmup=-1
expect_error '--modes: unknown mode `fp8`' --modes=fp32,fp8
missing="$TEST_TMPDIR/gpu_check_test_missing_table"
rm -rf "$missing"
expect_error "--table: cannot read \`$missing\`" --table="$missing"
expect_error '--profile: unknown mode `fp8`' --profile=fp8

# The split BatchNorm comparison: ours' lines only, a mode the split run
# lacks shows "-".
split_log="$TEST_TMPDIR/gpu_check_test_split.log"
echo "BENCH impl=ours model=resnet50 mode=fp32 batch=256 warmup=3 steps=20 images_per_s=1350.0" >"$split_log"
echo "BENCH impl=torch model=resnet50 mode=fp32 batch=256 images_per_s=5.0" >>"$split_log"
split_table="$("$SCRIPT" --split-table="$FIXTURE,$split_log" | tr -s ' ')"
check "split fp32 row" "$split_table" " fp32 900.0 1350.0 1.50"
check "split bf16 row" "$split_table" " bf16 1500.0 - -"
check "split table ignores PyTorch" "$(grep -c 'fp16' <<<"$split_table")" "0"
expect_error "--split-table: cannot read \`$missing\`" --split-table="$FIXTURE,$missing"

table="$("$SCRIPT" --table="$FIXTURE" | tr -s ' ')"
# fp32: both sides, same batch and steps: 900 / 1000.
check "fp32 row" "$table" " fp32 900.0 1000.0 0.90"
# bf16: PyTorch ran another step count, so no ratio.
check "bf16 row" "$table" " bf16 1500.0 2000.0 -"
# fp16: ours missing.
check "fp16 row" "$table" " fp16 - 3000.0 -"
# A PyTorch run on the CPU is never compared.
cpu_table="$(sed 's/device=cuda:0/device=cpu/' "$FIXTURE" | "$SCRIPT" --table=/dev/stdin | tr -s ' ')"
check "cpu row" "$cpu_table" " fp32 900.0 1000.0 - (run on the CPU: a smoke test, not comparable)"
# Models of different sizes on the two sides are named.
odd_table="$(sed '/impl=torch.*mode=fp32/s/params=23520842/params=11173962/' "$FIXTURE" | "$SCRIPT" --table=/dev/stdin)"
check "params mismatch" "$odd_table" "WARNING: fp32: the models differ: 23520842 parameters in ours, 11173962 in PyTorch"
check "params mismatch, other rows" "$(grep -c WARNING <<<"$odd_table")" "1"

out="$(OUT="$TEST_TMPDIR/out" "$SCRIPT" --dry-run --skip-torch 2>&1)"
rc=$?
[ "$rc" = 0 ] || { echo "FAIL: dry run exited $rc"; echo "$out"; failures=$((failures + 1)); }
# The phases in order (the build phase shows up only where bazel is installed):
# the benchmarks come before the tests.
order="$(grep -E '^==== ' <<<"$out" | grep -v '^==== build' | sed -E 's/^==== //; s/ \(.*//; s/,.*//' | paste -sd'|')"
expected="environment|benchmark: ours|benchmark: PyTorch eager|benchmark: ours with the default again|benchmark: ours with our batch-norm kernels|benchmark: ours with cuDNN persistent batch norm|benchmark: ours with vectorized elementwise kernels|benchmark: ours with cuDNN's heuristic convolution picks|benchmark: all-reduce on device buffers|gpu tests|summary"
if [ "$order" != "$expected" ]; then
  echo "FAIL: phase order: $order, expected $expected"
  failures=$((failures + 1))
fi
# --profile adds the kernel profile after the benchmarks, before the tests.
out="$("$SCRIPT" --dry-run --skip-torch --profile=bf16 2>&1)"
order="$(grep -E '^==== ' <<<"$out" | grep -v '^==== build' | sed -E 's/^==== //; s/ \(.*//; s/,.*//; s/:.*//' | paste -sd'|')"
expected="environment|benchmark|benchmark|benchmark|benchmark|benchmark|benchmark|benchmark|benchmark|profile|gpu tests|summary"
if [ "$order" != "$expected" ]; then
  echo "FAIL: phase order with --profile: $order, expected $expected"
  failures=$((failures + 1))
fi
check "profile dry run" "$out" "--print-units base"
check "dry run prints the benchmark command" "$out" "would run: "
check "dry run skips torch" "$out" "skipped (--skip-torch)"
for f in gpu_check.log bench.log summary.txt; do
  [ -f "$TEST_TMPDIR/out/$f" ] || { echo "FAIL: no $f in OUT"; failures=$((failures + 1)); }
done
check "summary file" "$(cat "$TEST_TMPDIR/out/summary.txt")" "==== summary"

# Stopped from outside (as the device's time limit does, TERM to the whole
# process group) in the middle of a benchmark: it exits at once, stops the
# benchmark and leaves a summary that says where it stopped. A stand-in for
# python plays a PyTorch that imports and a benchmark that prints five
# steps and then nothing for five minutes (the benchmark runs under
# `timeout`, in a process group of its own, and would not see the signal,
# nor die of a broken pipe, if the script did not stop it).
fake_python="$TEST_TMPDIR/fake_python"
fake_pid_file="$TEST_TMPDIR/fake_bench.pid"
rm -f "$fake_pid_file"
cat >"$fake_python" <<EOF_PY
#!/bin/sh
case "\$*" in
  *torch_train_step_bench.py*)
    echo \$\$ >"$fake_pid_file"
    for i in 1 2 3 4 5; do echo "step \$i"; done
    exec sleep 300 ;;
  *"import torch"*) echo "2.0 cuda None available False" ;;
  *) exit 1 ;;
esac
EOF_PY
chmod +x "$fake_python"
stop_out="$TEST_TMPDIR/stop"
mkdir -p "$stop_out"
OUT="$stop_out" PYTHON="$fake_python" setsid "$SCRIPT" --dry-run >"$TEST_TMPDIR/stop.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  grep -q 'step 5' "$stop_out/gpu_check.log" 2>/dev/null && break
  sleep 0.1
done
kill -TERM -- "-$pid"
if ! gone_within 300 "$pid"; then
  echo "FAIL: still running 30 s after SIGTERM"
  kill -KILL -- "-$pid"
  failures=$((failures + 1))
fi
wait "$pid"
rc=$?
[ "$rc" = 143 ] || { echo "FAIL: stopped run exited $rc, expected 143"; failures=$((failures + 1)); }
check "summary of a stopped run" "$(cat "$stop_out/summary.txt")" "stopped by a signal during: benchmark: PyTorch eager"
bench_pid="$(cat "$fake_pid_file" 2>/dev/null)"
if [ -z "$bench_pid" ]; then
  echo "FAIL: the stand-in benchmark never started"
  failures=$((failures + 1))
else
  if ! gone_within 150 "$bench_pid"; then
    echo "FAIL: the benchmark (pid $bench_pid) still runs 15 s after the script was stopped"
    kill -KILL "$bench_pid"
    failures=$((failures + 1))
  fi
fi

if [ "$failures" -gt 0 ]; then
  echo "$failures failures"
  exit 1
fi
echo "all checks passed"
