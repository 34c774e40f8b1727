#!/usr/bin/env bash
# tools/bench/ncu_summary.py on a fixture of ncu's CSV (inputs for the
# parser, not measurements): totals, the share of our kernels, grouping of
# one kernel's instances, ordering, and its errors.
set -uo pipefail
SCRIPT="$(dirname "$0")/bench/ncu_summary.py"
FIXTURE="$(dirname "$0")/testdata/ncu_step.csv"
failures=0

check() {  # check NAME HAYSTACK NEEDLE
  if ! grep -qF -- "$3" <<<"$2"; then
    echo "FAIL: $1: expected to find \`$3\` in:"
    echo "$2"
    failures=$((failures + 1))
  fi
}

out="$(python3 "$SCRIPT" "$FIXTURE" | tr -s ' ')"
check "totals" "$out" "5 kernels, 10.00 ms of GPU time"
check "our share" "$out" "this project's kernels (ddp::): 4.00 ms (40.0%); libraries' (cuDNN, cuBLAS): 6.00 ms (60.0%)"
# The largest group first; the two Copy lambdas are one group, apart from
# the float ElementwiseKernel; other metrics are not counted.
first="$(grep -A1 ' ms % calls kernel' <<<"$out" | tail -1)"
check "largest first" "$first" " 6.00 60.0 1 implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, 0, 0, 1>"
check "lambdas grouped" "$out" " 1.00 10.0 2 ddp::ElementwiseKernel<2, ddp::Copy>"
check "template kept" "$out" " 2.00 20.0 1 ddp::ElementwiseKernel<float>"
check "other metric ignored" "$out" " 1.00 10.0 1 ddp::MeanVarKernel<float>"
check "--top" "$(python3 "$SCRIPT" --top=1 "$FIXTURE" | wc -l | tr -d ' ')" "4"

err="$(echo 'not a csv' | python3 "$SCRIPT" - 2>&1)"
check "no rows" "$err" "ncu_summary: no CSV rows (was ncu run with --csv?)"
err="$(sed 's/"ns"/"cycle"/' "$FIXTURE" | python3 "$SCRIPT" - 2>&1)"
check "bad unit" "$err" "unknown time unit 'cycle' (run ncu with --print-units base)"
err="$(python3 "$SCRIPT" /nonexistent.csv 2>&1)"
check "missing file" "$err" "ncu_summary: cannot read /nonexistent.csv"

if [ "$failures" -gt 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "ncu_summary_test: all checks passed"
