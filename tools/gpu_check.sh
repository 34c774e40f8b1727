#!/usr/bin/env bash
# Issue 9's GPU check, in one run on a machine with an NVIDIA GPU:
#
#   1. environment: the GPU (nvidia-smi), the tools and libraries found;
#   2. build (bazel --config=cuda) of the training-step benchmark;
#   3. ResNet-50 training steps (CIFAR-shaped synthetic input, batch 256) on
#      cuda:0, ours: //nn/cuda:train_step_bench, one BENCH line per mode;
#   4. the same in PyTorch eager (tools/bench/torch_train_step_bench.py) when
#      python3 imports torch, and the table of images/s with ours/PyTorch;
#   4a. ours again with the same settings (another process: the noise);
#   4b. ours again with our own BatchNorm kernels (DDP_NN_CUDA_BN=own; the
#      default is cuDNN's), every mode, and their ratio to the default;
#   4c. the same with cuDNN's persistent batch norm
#      (DDP_NN_CUDA_BN=cudnn_persistent), with the vectorized elementwise
#      kernels (DDP_NN_CUDA_VEC=1) and with cuDNN's heuristic convolution
#      picks instead of timed ones (DDP_NN_CUDA_CONV_SEARCH=heuristic, as
#      PyTorch with cudnn.benchmark off);
#   4d. which algorithm each convolution got (logged by 4a's run, which
#      also measures the noise: conv_search.log);
#   5. all-reduce on device buffers, 2 ranks on the GPU, with the staged
#      reduction on the device and on the host (device_allreduce_bench);
#   6. with --profile, every kernel's time in one training step per mode
#      (Nsight Compute), summed per kernel function;
#   7. build and run every test tagged `gpu`, with a per-test timeout, going
#      on after failures.
#
# With OUT set (a folder), the whole output, the BENCH lines, the all-reduce
# figures, the summary, the failed tests' logs and (--profile) the kernel
# profile are written there too (up to eight files). The summary is rewritten
# after every phase and each failed test's log appended as it ends, so a run
# stopped from outside (SIGTERM, ^C) keeps what it found; a phase with no
# time left is skipped, not started and timed out.
#
# The benchmarks come before the tests so that their figures exist even if
# the tests run long. Every phase has a timeout taken from one overall budget
# (--budget, 470 s by default: the issue asks for under 8 minutes on one H200),
# and the elapsed time of each phase is printed at the end.
#
# A GPU machine without Bazel or the Debian libraries runs prebuilt binaries:
# on a machine that builds (this repository's dev machines),
#     tools/gpu_check.sh --make-bundle
# writes .gpu_bundle/ (git-ignored: the benchmark, the gpu tests and their
# non-system shared libraries, stripped, in one tar.xz); copy or carry that
# folder next to the working tree on the GPU machine and run
# tools/gpu_check.sh there: without bazel or the libraries' headers it uses
# the bundle by itself (--bundle forces it). The CUDA runtime libraries (cuBLAS, cuDNN) are taken
# from the GPU machine (CUDA toolkit or PyTorch's nvidia-* wheels).
#
# Without a GPU, --dry-run walks through the same phases and prints the
# commands that need a GPU instead of running them; it runs both benchmarks
# on the CPU with a tiny batch (ours if it is built), as a smoke test: their
# lines say device=cpu and the table compares nothing.
#
# Usage: tools/gpu_check.sh [options]   (see --help)
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || exit 1
readonly REPO_ROOT
cd "$REPO_ROOT" || exit 1

BUDGET_S=470
MODES="fp32,bf16,fp16"
BATCH=256
WARMUP=3
STEPS=20
TEST_TIMEOUT_S=120
TEST_JOBS=4
SKIP_BUILD=0
SKIP_TESTS=0
SKIP_TORCH=0
DRY_RUN=0
USE_BUNDLE=auto
BUNDLE_DIR="$REPO_ROOT/.gpu_bundle"
# The least time a phase is started with (seconds).
MIN_PHASE_S=20
FASHION_MNIST_DIR=/usr/share/datasets/fashion-mnist
MAKE_BUNDLE=0
TABLE_FROM=""
SPLIT_TABLE_FROM=""
SKIP_COLLECTIVES=0
PROFILE=0
PROFILE_MODES="fp32,bf16"
# All-reduce on device buffers, staged reduction on the device and on the host.
readonly ALLREDUCE_BENCH=//transport/cuda:device_allreduce_bench


usage() {
  cat <<EOF
Usage: tools/gpu_check.sh [options]

  --budget=S          whole run's deadline in seconds (default $BUDGET_S)
  --modes=LIST        precision modes of both benchmarks, comma-separated
                      (default $MODES; known: fp32, bf16, fp16)
  --batch=N           images per step (default $BATCH)
  --warmup=N          untimed steps per mode (default $WARMUP)
  --steps=N           timed steps per mode (default $STEPS)
  --test-timeout=S    per-test timeout of the gpu tests (default $TEST_TIMEOUT_S)
  --test-jobs=N       gpu tests run at once (default $TEST_JOBS)
  --skip-build        use what is already built (bazel-bin, or the bundle)
  --skip-tests        no gpu tests
  --only-bench        the benchmarks only (= --skip-tests)
  --skip-torch        do not run the PyTorch benchmark
  --skip-collectives  do not run the device all-reduce benchmark (2 ranks
                      on the GPU, staged reduction on the device and on the host)
  --variant-modes=M   the modes of the variant runs (4a-4c; default: --modes);
                      empty (--variant-modes=) skips them, leaving the time to
                      the tests
  --profile[=MODES]   also time every kernel of one training step with Nsight
                      Compute (ncu) per mode (default fp32,bf16) and print where
                      the GPU time goes (tools/bench/ncu_summary.py)
  --bundle[=DIR]      run prebuilt binaries from DIR (default .gpu_bundle)
                      instead of building with bazel
  --make-bundle[=DIR] build the benchmark and the gpu tests here and pack them
                      with their non-system libraries into DIR (default
                      .gpu_bundle), then stop
  --table=FILE        print the comparison table from BENCH lines in FILE
  --split-table=A,B   print split/default images/s per mode from ours'
                      BENCH lines in A (default run) and B (split BatchNorm)
                      (a saved log) and stop
  --dry-run           no GPU needed: run the phases' logic, print the GPU
                      commands instead of running them, and run both
                      benchmarks on the CPU with a tiny batch (not compared)
  --help              this text

Environment: OUT (a folder that receives gpu_check.log, the whole output;
bench.log; summary.txt; failed_tests.log, the end of each failed test's log),
PYTHON (the python3 with torch; default: python3).
EOF
}

die() {
  echo "gpu_check: $*" >&2
  exit 2
}

for arg in "$@"; do
  case "$arg" in
    --budget=*) BUDGET_S="${arg#*=}" ;;
    --modes=*) MODES="${arg#*=}" ;;
    --variant-modes=*) VARIANT_MODES="${arg#*=}" VARIANT_MODES_GIVEN=1 ;;
    --batch=*) BATCH="${arg#*=}" ;;
    --warmup=*) WARMUP="${arg#*=}" ;;
    --steps=*) STEPS="${arg#*=}" ;;
    --test-timeout=*) TEST_TIMEOUT_S="${arg#*=}" ;;
    --test-jobs=*) TEST_JOBS="${arg#*=}" ;;
    --skip-build) SKIP_BUILD=1 ;;
    --skip-tests | --only-bench) SKIP_TESTS=1 ;;
    --skip-torch) SKIP_TORCH=1 ;;
    --skip-collectives) SKIP_COLLECTIVES=1 ;;
    --profile) PROFILE=1 ;;
    --profile=*) PROFILE=1 PROFILE_MODES="${arg#*=}" ;;
    --bundle) USE_BUNDLE=1 ;;
    --bundle=*) USE_BUNDLE=1 BUNDLE_DIR="${arg#*=}" ;;
    --make-bundle) MAKE_BUNDLE=1 ;;
    --make-bundle=*) MAKE_BUNDLE=1 BUNDLE_DIR="${arg#*=}" ;;
    --table=*) TABLE_FROM="${arg#*=}" ;;
    --split-table=*) SPLIT_TABLE_FROM="${arg#*=}" ;;
    --dry-run) DRY_RUN=1 ;;
    --help | -h) usage; exit 0 ;;
    *) usage >&2; die "unknown argument \`$arg\`" ;;
  esac
done

for pair in "budget:$BUDGET_S" "batch:$BATCH" "steps:$STEPS" "test-timeout:$TEST_TIMEOUT_S" \
  "test-jobs:$TEST_JOBS"; do
  [[ "${pair#*:}" =~ ^[1-9][0-9]*$ ]] || die "--${pair%%:*} must be a positive integer, got \`${pair#*:}\`"
done
[[ "$WARMUP" =~ ^[0-9]+$ ]] || die "--warmup must be a non-negative integer, got \`$WARMUP\`"
IFS=',' read -r -a PROFILE_MODE_LIST <<<"$PROFILE_MODES"
for m in "${PROFILE_MODE_LIST[@]}"; do
  case "$m" in
    fp32 | bf16 | fp16) ;;
    *) die "--profile: unknown mode \`$m\` (known: fp32, bf16, fp16)" ;;
  esac
done
IFS=',' read -r -a MODE_LIST <<<"$MODES"
[ "${#MODE_LIST[@]}" -gt 0 ] || die "--modes is empty"
for m in "${MODE_LIST[@]}"; do
  case "$m" in
    fp32 | bf16 | fp16) ;;
    *) die "--modes: unknown mode \`$m\` (known: fp32, bf16, fp16)" ;;
  esac
done

# ---------------------------------------------------------------- the table

# Reads BENCH lines (key=value words) on stdin; prints images/s of ours and
# PyTorch's per mode, and the ratio when both ran with the same batch and
# step count. A mode that one side did not produce shows "-".
print_table() {
  awk '
    $1 == "BENCH" {
      delete kv
      for (i = 2; i <= NF; ++i) { split($i, p, "="); kv[p[1]] = p[2] }
      key = kv["mode"]
      if (!(key in seen)) { seen[key] = 1; order[++n] = key }
      ips[kv["impl"], key] = kv["images_per_s"]
      shape[kv["impl"], key] = kv["batch"] "x" kv["steps"]
      dev[kv["impl"], key] = kv["device"]
      params[kv["impl"], key] = kv["params"]
    }
    END {
      if (n == 0) { print "  (no BENCH lines)"; exit }
      printf "  %-6s %14s %14s %14s\n", "mode", "ours img/s", "torch img/s", "ours/torch"
      for (i = 1; i <= n; ++i) {
        m = order[i]
        o = ((("ours", m) in ips)) ? ips["ours", m] : "-"
        t = ((("torch", m) in ips)) ? ips["torch", m] : "-"
        r = "-"
        cpu = dev["ours", m] ~ /^cpu/ || dev["torch", m] ~ /^cpu/
        if (o != "-" && t != "-" && shape["ours", m] == shape["torch", m] && !cpu) r = sprintf("%.2f", o / t)
        note = cpu ? "  (run on the CPU: a smoke test, not comparable)" : ""
        printf "  %-6s %14s %14s %14s%s\n", m, o, t, r, note
        if (o != "-" && t != "-" && params["ours", m] != params["torch", m]) {
          printf "  WARNING: %s: the models differ: %s parameters in ours, %s in PyTorch\n", m, params["ours", m],
                 params["torch", m]
        }
      }
    }'
}

# Ours' images/s per mode in two logs of BENCH lines, the default run ($2)
# and a variant's ($3, named $1: "split", "cudnn"), and variant/default. A
# mode one run lacks shows "-".
print_variant_table() {
  { grep -h '^BENCH impl=ours' "$2" | sed 's/^/default /'
    grep -h '^BENCH impl=ours' "$3" | sed 's/^/variant /'; } |
    awk -v name="$1" '{
      delete kv
      for (i = 3; i <= NF; ++i) { split($i, word, "="); kv[word[1]] = word[2] }
      ips[$1, kv["mode"]] = kv["images_per_s"]
      if (!(kv["mode"] in seen)) { seen[kv["mode"]] = 1; order[++n] = kv["mode"] }
    }
    END {
      printf "  %-6s %14s %14s %14s\n", "mode", "default img/s", name " img/s", name "/default"
      for (i = 1; i <= n; ++i) {
        m = order[i]
        d = (("default", m) in ips) ? ips["default", m] : "-"
        q = (("variant", m) in ips) ? ips["variant", m] : "-"
        r = (d != "-" && q != "-" && d > 0) ? sprintf("%.2f", q / d) : "-"
        printf "  %-6s %14s %14s %14s\n", m, d, q, r
      }
    }'
}

if [ -n "$TABLE_FROM" ]; then
  [ -r "$TABLE_FROM" ] || die "--table: cannot read \`$TABLE_FROM\`"
  print_table <"$TABLE_FROM"
  exit 0
fi
if [ -n "$SPLIT_TABLE_FROM" ]; then
  IFS=',' read -r split_a split_b <<<"$SPLIT_TABLE_FROM"
  for f in "$split_a" "$split_b"; do
    [ -n "$f" ] && [ -r "$f" ] || die "--split-table: cannot read \`$f\` (give DEFAULT_LOG,SPLIT_LOG)"
  done
  print_variant_table split "$split_a" "$split_b"
  exit 0
fi

# The default run and the tests must run the default kernels: the variants
# set their own switch.
for v in DDP_NN_CUDA_BN DDP_NN_CUDA_BN_SPLIT DDP_NN_CUDA_VEC DDP_NN_CUDA_CONV_LOG DDP_NN_CUDA_CONV_SEARCH; do
  if [ -n "${!v:-}" ]; then
    echo "gpu_check: ignoring $v=${!v} from the environment (the variants set it themselves)" >&2
    unset "$v"
  fi
done

# --------------------------------------------------------------- time keeping

START_S=$(date +%s)
readonly START_S
PHASE_NAMES=()
PHASE_TIMES=()
PHASE_RESULTS=()
PHASE_START=0
CURRENT_PHASE=""

now() { date +%s; }
left_s() { echo $((BUDGET_S - ($(now) - START_S))); }

begin_phase() {
  CURRENT_PHASE="$1"
  PHASE_START=$(now)
  printf '\n==== %s (at %ds, %ds left)\n' "$1" $(($(now) - START_S)) "$(left_s)"
}

end_phase() {
  PHASE_NAMES+=("$CURRENT_PHASE")
  PHASE_TIMES+=($(($(now) - PHASE_START)))
  PHASE_RESULTS+=("$1")
  printf -- '---- %s: %s in %ds\n' "$CURRENT_PHASE" "$1" $(($(now) - PHASE_START))
  save_summary
}

# The summary so far ($1: a note for its heading): phases, gpu tests (those
# finished, while they still run), the ResNet-50 table.
summary() {
  echo
  echo "==== summary ($(($(now) - START_S))s of the ${BUDGET_S}s budget)${1:+; $1}"
  for i in "${!PHASE_NAMES[@]}"; do
    printf '  %5ds  %-60s %s\n' "${PHASE_TIMES[$i]}" "${PHASE_NAMES[$i]}" "${PHASE_RESULTS[$i]}"
  done
  local tests="${TEST_SUMMARY:-}"
  if { [ -z "$tests" ] || [ ! -s "$tests" ]; } && compgen -G "$WORK/results/*" >/dev/null; then
    tests="$WORK/tests_so_far.txt"
    sort "$WORK/results"/* >"$tests"
  fi
  if [ -n "$tests" ] && [ -s "$tests" ]; then
    echo
    echo "gpu tests: $(awk '$2 == "PASSED"' "$tests" | wc -l) passed of $(wc -l <"$tests")"
    awk '$2 != "PASSED" {print "  " $0}' "$tests"
  fi
  echo
  echo "ResNet-50 images/s (${GPU_NAME:-no GPU}):"
  [ -r "$WORK/table.txt" ] && cat "$WORK/table.txt"
  return 0
}

# Keeps $OUT/summary.txt current after every phase: a run killed at its
# wall-clock limit still leaves what it had found.
save_summary() {
  [ -n "${OUT:-}" ] || return 0
  summary "$@" >"$OUT/summary.txt"
}

# Stopped from outside (the device's limit, ^C): stop the commands still
# running (each under its own `timeout`, which passes the signal on to its
# process group), and leave the summary so far.
on_signal() {
  trap - TERM INT
  save_summary "stopped by a signal during: $CURRENT_PHASE"
  echo "gpu_check: stopped by a signal $(($(now) - START_S))s in, during: $CURRENT_PHASE" 2>/dev/null
  local pid
  if [ -f "$WORK/running" ]; then
    while read -r pid; do kill -TERM "$pid" 2>/dev/null; done <"$WORK/running"
  fi
  for pid in $(jobs -p); do
    [ "$pid" = "${TEE_PID:-}" ] && continue
    pkill -TERM -P "$pid" 2>/dev/null
    kill -TERM "$pid" 2>/dev/null
  done
  exit 143
}

# Seconds a phase may take: its own cap, never past the budget minus what the
# later phases need (reserve_s); 0 when nothing is left (run_logged then
# starts nothing).
phase_limit() {
  local cap=$1 reserve=$2 left
  left=$(($(left_s) - reserve))
  [ "$left" -lt "$cap" ] && cap=$left
  [ "$cap" -lt 0 ] && cap=0
  echo "$cap"
}

# run_logged's status for a command it did not start (no time left).
readonly NOT_STARTED=253

# `limited SECONDS CMD...`: runs CMD under `timeout` and returns its status.
# timeout puts itself and CMD in a process group of their own, which a
# signal to this script's group (^C, the device's limit) never reaches, so
# its pid goes into $WORK/running for on_signal to stop it.
limited() {
  local limit=$1
  shift
  timeout --kill-after=10 "$limit" "$@" &
  local pid=$!
  echo "$pid" >>"$WORK/running"
  wait "$pid"
}

# Runs a command under a deadline; its output goes to the terminal and to a log.
# The pipeline runs in the background and is waited for: bash runs a trap
# only once the foreground command has ended, but interrupts a `wait`.
run_logged() {
  local limit=$1 log=$2
  shift 2
  # A few seconds cannot hold a GPU process's start (the CUDA context alone
  # takes some): such a phase would be killed having recorded nothing.
  if [ "$limit" -lt "$MIN_PHASE_S" ]; then
    echo "+ not started (${limit}s of budget left, under ${MIN_PHASE_S}s): $*"
    return "$NOT_STARTED"
  fi
  echo "+ (limit ${limit}s) $*"
  (
    limited "$limit" "$@" 2>&1 | tee -a "$log"
    exit "${PIPESTATUS[0]}"
  ) &
  wait "$!"
}

describe_rc() {
  case "$1" in
    0) echo "ok" ;;
    124 | 137) echo "TIMED OUT" ;;
    "$NOT_STARTED") echo "skipped (out of budget)" ;;
    *) echo "FAILED (exit $1)" ;;
  esac
}

WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
trap on_signal TERM INT
# A signal to the whole group also ends the tee into $OUT/gpu_check.log,
# and bash then reports the killed job on that broken pipe: with SIGPIPE's
# default action it would die there, before on_signal runs. A trap (unlike
# an ignored signal) is not inherited by the commands this script starts.
trap ':' PIPE
BENCH_LOG="$WORK/bench.log"
: >"$BENCH_LOG"

copy_out() {
  [ -n "${OUT:-}" ] || return 0
  cp -f "$@" "$OUT/"
}

# ----------------------------------------------------------- making a bundle

# The shared libraries the GPU machine is expected to have or that must come
# from its own driver and CUDA installation.
is_system_lib() {
  case "$(basename "$1")" in
    linux-vdso* | ld-linux* | libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libresolv.so*) return 0 ;;
    libstdc++.so* | libgcc_s.so*) return 0 ;;
    libcuda.so* | libnvidia-* | libcublas* | libcudnn* | libnccl* | libnvrtc* | libnvJitLink*) return 0 ;;
  esac
  return 1
}

gpu_test_labels() {
  bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null | sort
}

# A test target's `args` (e.g. a --gtest_filter: several targets share one
# source), one per line, as bazel passes them.
test_args() {
  # shellcheck disable=SC2016  # the Python text is not for the shell
  bazel query --output=build "$1" 2>/dev/null | python3 -c '
import ast, re, sys
m = re.search(r"^\s*args = (\[.*?\]),?$", sys.stdin.read(), re.M | re.S)
for a in ast.literal_eval(m.group(1)) if m else []:
    if "$(" in a:
        sys.exit("args with make variables are not supported: " + a)
    print(a)
'
}

make_bundle() {
  command -v bazel >/dev/null || die "--make-bundle needs bazel here"
  local labels
  labels="$(gpu_test_labels)" || die "bazel query for the gpu tests failed"
  echo "gpu_check: building the benchmark and $(echo "$labels" | wc -l) gpu tests (--config=cuda)"
  # shellcheck disable=SC2086
  bazel build --config=cuda //nn/cuda:train_step_bench "$ALLREDUCE_BENCH" $labels || die "the build failed"
  local bin stage
  bin="$(bazel info --config=cuda bazel-bin 2>/dev/null)" || die "bazel info failed"
  stage="$WORK/bundle"
  mkdir -p "$stage/bin" "$stage/lib/ucx" "$stage/args"
  local targets=("//nn/cuda:train_step_bench" "$ALLREDUCE_BENCH")
  for l in $labels; do targets+=("$l"); done
  : >"$stage/tests.txt"
  # Executables the tests run from their runfiles (e.g. //examples:train).
  local data_labels
  # shellcheck disable=SC2086
  data_labels="$(bazel query "kind('.*_binary', labels(data, set($labels)))" 2>/dev/null | sort -u)"
  local t rel lib
  for t in "${targets[@]}" $data_labels; do
    rel="${t#//}"
    rel="${rel/://}"
    [ -x "$bin/$rel" ] || die "no executable at $bin/$rel for $t"
    local name="${rel//\//__}"
    if grep -qxF "$t" <<<"$data_labels"; then
      # Where Runfile() looks: $TEST_SRCDIR/$TEST_WORKSPACE/<path>.
      mkdir -p "$stage/runfiles/ddp/$(dirname "$rel")"
      cp -L "$bin/$rel" "$stage/runfiles/ddp/$rel"
    else
      cp -L "$bin/$rel" "$stage/bin/$name"
      if [ "$t" != "//nn/cuda:train_step_bench" ] && [ "$t" != "$ALLREDUCE_BENCH" ]; then
        echo "$name $t" >>"$stage/tests.txt"
        test_args "$t" >"$stage/args/$name" || die "cannot read the args of $t"
      fi
    fi
    # Every non-system library the binary loads, the project's own (_solib)
    # included; LD_LIBRARY_PATH puts them ahead of the binary's RUNPATH.
    while read -r lib; do
      [ -n "$lib" ] && ! is_system_lib "$lib" && cp -Ln "$lib" "$stage/lib/" 2>/dev/null
    done < <(ldd "$bin/$rel" | awk '$3 ~ /^\// {print $3}')
  done
  # UCX loads its transports as modules (shared memory via CMA is the one the
  # tests need on one host).
  if [ -e /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 ]; then
    cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 "$stage/lib/ucx/"
  fi
  chmod -R u+w "$stage"
  find "$stage/bin" "$stage/lib" "$stage/runfiles" -type f -exec strip --strip-debug {} + 2>/dev/null
  {
    echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!.gpu_bundle' || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%FT%TZ) on $(grep -m1 '^PRETTY_NAME=' /etc/os-release | cut -d'"' -f2), $(ldd --version | head -1)"
  } >"$stage/MANIFEST"
  mkdir -p "$BUNDLE_DIR"
  rm -f "$BUNDLE_DIR/bundle.tar.xz.tmp"
  tar -C "$stage" -cf - . | xz -T0 -6 >"$BUNDLE_DIR/bundle.tar.xz.tmp" || die "packing the bundle failed"
  mv -f "$BUNDLE_DIR/bundle.tar.xz.tmp" "$BUNDLE_DIR/bundle.tar.xz"
  cp -f "$stage/MANIFEST" "$BUNDLE_DIR/MANIFEST"
  # This script as it was when the bundle was made: the device runs it
  # (cp .gpu_bundle/gpu_check.sh tools/gpu_check.sh) where the working tree
  # sent may hold an older one.
  cp -f "$REPO_ROOT/tools/gpu_check.sh" "$BUNDLE_DIR/gpu_check.sh"
  # Tests train on Fashion-MNIST from Debian's folder: the test split as it
  # is (the ddp gpu tests read it) and the first 8,000 of the 60,000
  # training images and labels (the count in each IDX header rewritten; no
  # gpu test reads that split today, but a loader asking for it finds it).
  # The whole training set (26 MB) put the working tree and the bundle over
  # the device tool's 64 MiB.
  if [ -d "$FASHION_MNIST_DIR" ]; then
    mkdir -p "$BUNDLE_DIR/fashion-mnist"
    cp -f "$FASHION_MNIST_DIR"/t10k-*-ubyte.gz "$BUNDLE_DIR/fashion-mnist/"
    python3 - "$FASHION_MNIST_DIR" "$BUNDLE_DIR/fashion-mnist" <<'PY' || die "trimming Fashion-MNIST's training split failed"
import gzip, struct, sys
src, dst = sys.argv[1], sys.argv[2]
keep = 8000
for name, header, record in (("train-images-idx3-ubyte.gz", 16, 784), ("train-labels-idx1-ubyte.gz", 8, 1)):
    with gzip.open(f"{src}/{name}") as f:
        head = f.read(header)
        body = f.read(keep * record)
    if len(head) != header or len(body) != keep * record:
        sys.exit(f"{src}/{name}: shorter than {keep} records")
    with gzip.open(f"{dst}/{name}", "wb", compresslevel=9) as f:
        f.write(head[:4] + struct.pack(">I", keep) + head[8:] + body)
PY
  else
    echo "gpu_check: WARNING: no $FASHION_MNIST_DIR here; tests that train on it will fail on the GPU machine"
  fi
  echo "gpu_check: wrote $BUNDLE_DIR/bundle.tar.xz ($(du -h "$BUNDLE_DIR/bundle.tar.xz" | cut -f1);" \
    "$(du -sh "$stage" | cut -f1) unpacked): $(find "$stage/bin" -type f | wc -l) binaries," \
    "$(find "$stage/lib" -type f | wc -l) libraries"
  cat "$BUNDLE_DIR/MANIFEST"
}

if [ "$MAKE_BUNDLE" = 1 ]; then
  make_bundle
  exit 0
fi

# ------------------------------------------------------------------- phases

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" || die "cannot create OUT=$OUT"
  rm -f "$OUT/failed_tests.log"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
  TEE_PID=$!
fi

# What the WORKSPACE takes from the system (tools/setup.sh installs it).
BUILD_HEADERS=(/usr/include/ucp/api/ucp.h /usr/include/gflags/gflags.h /usr/include/glog/logging.h
  /usr/include/gtest/gtest.h /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h /usr/include/dnnl.h
  /usr/include/hwloc.h /usr/include/nlohmann/json.hpp /usr/include/zlib.h /usr/local/cuda/include/cuda_runtime.h
  /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/include/cudnn.h)
missing_headers() {
  local f
  for f in "${BUILD_HEADERS[@]}"; do [ -e "$f" ] || echo "$f"; done
}

# The bundle when bazel could not build here (no bazel, or the system
# libraries' headers are missing) and one is there.
if [ "$USE_BUNDLE" = auto ]; then
  USE_BUNDLE=0
  if [ -f "$BUNDLE_DIR/bundle.tar.xz" ] && { ! command -v bazel >/dev/null || [ -n "$(missing_headers)" ]; }; then
    USE_BUNDLE=1
  fi
fi

begin_phase "environment"
echo "repository: $REPO_ROOT at $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
echo "host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) memory, $(uname -r)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
  GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
else
  echo "nvidia-smi: not found"
  GPU_NAME=""
fi
[ -z "$GPU_NAME" ] && [ "$DRY_RUN" = 0 ] && echo "gpu_check: WARNING: no GPU seen by nvidia-smi; the GPU phases will fail (--dry-run runs without one)"
# The python3 that imports torch: PYTHON if set, else python3 on the PATH, else
# Debian's (python3-torch) when the PATH's has no torch.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ "$SKIP_TORCH" = 0 ] && ! python3 -c 'import torch' 2>/dev/null &&
    /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    PYTHON=/usr/bin/python3
  fi
fi
for tool in bazel nvcc "$PYTHON" xz; do
  if command -v "$tool" >/dev/null; then echo "found $tool: $(command -v "$tool")"; else echo "MISSING $tool"; fi
done
TORCH_OK=0
if [ "$SKIP_TORCH" = 0 ]; then
  if torch_info="$("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1)"; then
    echo "torch: $torch_info"
    TORCH_OK=1
  else
    echo "MISSING torch in $PYTHON: ${torch_info##*$'\n'}"
  fi
fi
if [ "$USE_BUNDLE" = 0 ]; then
  for f in $(missing_headers); do
    echo "MISSING $f (needed by the bazel build; tools/setup.sh installs the Debian packages)"
  done
  command -v bazel >/dev/null || echo "gpu_check: no bazel and no bundle at $BUNDLE_DIR/bundle.tar.xz:" \
    "our binaries cannot be built here (make one with --make-bundle on a dev machine and bring .gpu_bundle)"
fi
if [ "$USE_BUNDLE" = 1 ]; then
  echo "our binaries: from the bundle $BUNDLE_DIR/bundle.tar.xz"
elif command -v bazel >/dev/null; then
  echo "our binaries: built here with bazel --config=cuda"
else
  echo "our binaries: none (no bazel, no bundle)"
fi
# Some gpu tests train on Fashion-MNIST from Debian's folder (nn/data/idx.h).
if [ -e "$FASHION_MNIST_DIR/train-images-idx3-ubyte.gz" ]; then
  echo "found Fashion-MNIST in $FASHION_MNIST_DIR"
elif [ -d "$BUNDLE_DIR/fashion-mnist" ] && [ "$DRY_RUN" = 0 ]; then
  echo "copying the bundled Fashion-MNIST into $FASHION_MNIST_DIR (absent here)"
  mkdir -p "$FASHION_MNIST_DIR" && cp -n "$BUNDLE_DIR"/fashion-mnist/*-ubyte.gz "$FASHION_MNIST_DIR/" ||
    echo "MISSING Fashion-MNIST: cannot write $FASHION_MNIST_DIR; tests that train on it will fail"
else
  echo "MISSING Fashion-MNIST in $FASHION_MNIST_DIR: tests that train on it will fail (--make-bundle brings it)"
fi
end_phase "done"

BENCH_BIN=""
ALLREDUCE_BIN=""
# Prefix of our binaries' command lines (the bundle's library path).
OUR_ENV=()
# How the gpu tests run: "bazel" or "bundle"; empty when they cannot.
TEST_RUNNER=""
if [ "$USE_BUNDLE" = 1 ]; then
  begin_phase "unpack bundle"
  BUNDLE_ROOT="$WORK/bundle"
  mkdir -p "$BUNDLE_ROOT"
  rc=0
  if [ ! -f "$BUNDLE_DIR/bundle.tar.xz" ]; then
    echo "gpu_check: no bundle at $BUNDLE_DIR/bundle.tar.xz"
    rc=1
  elif command -v xz >/dev/null; then
    tar -C "$BUNDLE_ROOT" -xJf "$BUNDLE_DIR/bundle.tar.xz" || rc=$?
  else
    "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$BUNDLE_DIR/bundle.tar.xz" "$BUNDLE_ROOT" || rc=$?
  fi
  if [ "$rc" = 0 ]; then
    cat "$BUNDLE_ROOT/MANIFEST"
    bundle_commit="$(awk '/^commit / {print $2; exit}' "$BUNDLE_ROOT/MANIFEST")"
    # Only where there is a repository to compare with (a copy of the
    # working tree may come without .git).
    if git rev-parse --git-dir >/dev/null 2>&1 &&
      ! git diff --quiet "$bundle_commit" -- . ':!*.md' ':!docs' ':!tools/gpu_check*' ':!tools/testdata' 2>/dev/null; then
      echo "gpu_check: NOTE: the code differs from the commit the bundle was built from" \
        "($bundle_commit; this checkout: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')):" \
        "the binaries may not be this code"
    fi
    # The CUDA libraries the binaries need come from this machine: the
    # toolkit, or PyTorch's nvidia-* wheels.
    lib_dirs="$BUNDLE_ROOT/lib"
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      [ -d "$d" ] && lib_dirs="$lib_dirs:$d"
    done
    if [ "$TORCH_OK" = 1 ] || "$PYTHON" -c 'import nvidia' 2>/dev/null; then
      while read -r d; do lib_dirs="$lib_dirs:$d"; done < <("$PYTHON" - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit
seen = []
for root in nvidia.__path__:
    for lib in sorted(glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True)):
        d = os.path.dirname(lib)
        if d not in seen:
            seen.append(d)
print("\n".join(seen))
EOF
      )
    fi
    # Only for our binaries: exported, the bundle's older libraries would be
    # loaded into PyTorch's process too.
    OUR_ENV=(env "LD_LIBRARY_PATH=$lib_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      "UCX_MODULE_DIR=$BUNDLE_ROOT/lib/ucx")

    missing="$(for b in "$BUNDLE_ROOT"/bin/* "$BUNDLE_ROOT"/runfiles/ddp/*/*; do
      "${OUR_ENV[@]}" ldd "$b" | awk '/not found/ {print $1}'
    done | sort -u | tr '\n' ' ')"
    if [ -n "$missing" ]; then
      echo "gpu_check: MISSING libraries for the bundled binaries: $missing"
      echo "  (searched ${OUR_ENV[1]})"
      rc=1
    fi
    BENCH_BIN="$BUNDLE_ROOT/bin/nn__cuda__train_step_bench"
    ALLREDUCE_BIN="$BUNDLE_ROOT/bin/transport__cuda__device_allreduce_bench"
    TEST_RUNNER=bundle
  fi
  end_phase "$(describe_rc "$rc")"
elif [ "$SKIP_BUILD" = 1 ]; then
  BENCH_BIN="$REPO_ROOT/bazel-bin/nn/cuda/train_step_bench"
  ALLREDUCE_BIN="$REPO_ROOT/bazel-bin/transport/cuda/device_allreduce_bench"
  command -v bazel >/dev/null && TEST_RUNNER=bazel
elif command -v bazel >/dev/null; then
  begin_phase "build benchmark (bazel --config=cuda)"
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: would run: bazel build --config=cuda //nn/cuda:train_step_bench"
    end_phase "skipped (dry run)"
  else
    # The benchmark first: its figures come out even if the tests' build is long.
    run_logged "$(phase_limit 300 150)" "$WORK/build.log" bazel build --config=cuda //nn/cuda:train_step_bench \
      "$ALLREDUCE_BENCH"
    rc=$?
    end_phase "$(describe_rc "$rc")"
  fi
  BENCH_BIN="$REPO_ROOT/bazel-bin/nn/cuda/train_step_bench"
  ALLREDUCE_BIN="$REPO_ROOT/bazel-bin/transport/cuda/device_allreduce_bench"
  TEST_RUNNER=bazel
fi

BENCH_ARGS=(--model=resnet50 "--batch=$BATCH" "--warmup=$WARMUP" "--steps=$STEPS" "--modes=$MODES")

begin_phase "benchmark: ours, ResNet-50 batch $BATCH, modes $MODES"
if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: would run: ${BENCH_BIN:-(no benchmark binary)} ${BENCH_ARGS[*]}"
  if [ -n "$BENCH_BIN" ] && [ -x "$BENCH_BIN" ]; then
    # A smoke test of the binary on the CPU: tiny batch, figures not compared.
    run_logged "$(phase_limit 120 40)" "$BENCH_LOG" "${OUR_ENV[@]}" "$BENCH_BIN" --device=cpu --model=resnet50 --batch=2 \
      --warmup=0 --steps=1 "--modes=$MODES"
    end_phase "$(describe_rc $?) (dry run: on the CPU, batch 2, 1 step)"
  else
    end_phase "skipped (dry run, not built)"
  fi
elif [ -z "$BENCH_BIN" ] || [ ! -x "$BENCH_BIN" ]; then
  echo "gpu_check: no benchmark binary (${BENCH_BIN:-neither bazel nor a bundle})"
  end_phase "FAILED (not built)"
else
  run_logged "$(phase_limit 200 100)" "$BENCH_LOG" "${OUR_ENV[@]}" "$BENCH_BIN" "${BENCH_ARGS[@]}"
  end_phase "$(describe_rc $?)"
fi

begin_phase "benchmark: PyTorch eager, same settings"
TORCH_ARGS=("--batch=$BATCH" "--warmup=$WARMUP" "--steps=$STEPS" "--modes=$MODES")
if [ "$SKIP_TORCH" = 1 ]; then
  end_phase "skipped (--skip-torch)"
elif [ "$TORCH_OK" = 0 ]; then
  end_phase "skipped (torch does not import)"
elif [ "$DRY_RUN" = 1 ]; then
  # A smoke test of the script on the CPU: tiny batch, figures not compared.
  # PyTorch's CPU autocast has no f16 (and older releases no CPU GradScaler).
  cpu_modes="$(tr ',' '\n' <<<"$MODES" | grep -vx fp16 | paste -sd,)"
  if [ -z "$cpu_modes" ]; then
    end_phase "skipped (dry run: fp16 does not run on the CPU)"
  else
    run_logged "$(phase_limit 120 20)" "$BENCH_LOG" env PYTHONUNBUFFERED=1 "$PYTHON" \
      tools/bench/torch_train_step_bench.py --device=cpu --batch=2 --warmup=0 --steps=1 "--modes=$cpu_modes"
    end_phase "$(describe_rc $?) (dry run: on the CPU, batch 2, 1 step, modes $cpu_modes)"
  fi
else
  run_logged "$(phase_limit 150 60)" "$BENCH_LOG" env PYTHONUNBUFFERED=1 "$PYTHON" \
    tools/bench/torch_train_step_bench.py --device=cuda:0 "${TORCH_ARGS[@]}"
  end_phase "$(describe_rc $?)"
fi

echo
echo "ResNet-50 (CIFAR stem), batch $BATCH, $STEPS timed steps after $WARMUP, SGD momentum, TF32 off, ${GPU_NAME:-no GPU}:"
print_table <"$BENCH_LOG" | tee "$WORK/table.txt"
copy_out "$BENCH_LOG"

# Ours again with one setting switched by an environment assignment ($3),
# every mode, against the default run above: images/s and
# their ratio per mode, into $4. $1 names the variant in the table, $2 in
# the phase and the table's heading.
SPLIT_MODES="$MODES"
if [ "${VARIANT_MODES_GIVEN:-0}" = 1 ]; then SPLIT_MODES="$VARIANT_MODES"; fi
run_variant() {
  local name=$1 what=$2 assignment=$3 log=$4
  : >"$log"
  begin_phase "benchmark: ours with $what, modes $SPLIT_MODES"
  if [ "$DRY_RUN" = 1 ] || [ -z "$SPLIT_MODES" ]; then
    echo "dry run or no modes: would run: $assignment ${BENCH_BIN:-(no binary)}" \
      "${BENCH_ARGS[@]/#--modes=*/--modes=$SPLIT_MODES}"
    end_phase "skipped"
  elif [ -z "$BENCH_BIN" ] || [ ! -x "$BENCH_BIN" ]; then
    end_phase "FAILED (not built)"
  else
    # `env`: OUR_ENV is empty where the binary was built here, and timeout
    # would take the assignment for a command.
    run_logged "$(phase_limit 120 100)" "$log" "${OUR_ENV[@]}" env "$assignment" "$BENCH_BIN" \
      "${BENCH_ARGS[@]/#--modes=*/--modes=$SPLIT_MODES}"
    end_phase "$(describe_rc $?)"
    echo "$what against the default (ours):"
    print_variant_table "$name" "$BENCH_LOG" "$log" | tee -a "$WORK/table.txt"
    # cuDNN may decline a dtype; our kernels then run it under its label.
    grep -h 'declined' "$log" | sort -u | sed 's/^/  note: /' | tee -a "$WORK/table.txt"
  fi
}

# First the default settings again in a new process: how far two processes
# differ (each picks its convolution algorithms by timing) is the noise the
# other ratios are read against. Training-mode BatchNorm runs cuDNN's
# spatial kernels by default (PyTorch's for NCHW), measured against our own
# (split reductions, the default where cuDNN does not run) and cuDNN's
# persistent mode. The variants' BENCH lines are in gpu_check.log.
run_variant again "the default again" DDP_NN_CUDA_CONV_LOG=1 "$WORK/bench_again.log"
run_variant own "our batch-norm kernels" DDP_NN_CUDA_BN=own "$WORK/bench_bn_own.log"
run_variant persistent "cuDNN persistent batch norm" DDP_NN_CUDA_BN=cudnn_persistent \
  "$WORK/bench_bn_persistent.log"
# The elementwise kernels on whole 16-byte packs (off by default until
# measured here; kernels_test checks them against the CPU).
run_variant vec "vectorized elementwise kernels" DDP_NN_CUDA_VEC=1 "$WORK/bench_vec.log"
# The fp16 step spent 9 ms in a non-tensor-core convolution kernel that the
# timed search picked: cuDNN's heuristics (PyTorch's eager default) against it.
run_variant heuristic "cuDNN's heuristic convolution picks" DDP_NN_CUDA_CONV_SEARCH=heuristic \
  "$WORK/bench_conv_heuristic.log"

# Which algorithm each convolution got: the "again" run above logged every
# search (DDP_NN_CUDA_CONV_LOG=1: candidates and times, during the warm-up
# steps, so the timed steps are as in the default run) into
# conv_search.log; count the shapes per dtype, direction and pick.
CONV_LOG="$WORK/conv_search.log"
grep -h '^conv search: ' "$WORK/bench_again.log" >"$CONV_LOG" 2>/dev/null
if [ -s "$CONV_LOG" ]; then
  echo "convolution algorithms picked (shapes per dtype, direction and algorithm; conv_search.log):" |
    tee -a "$WORK/table.txt"
  # "conv search: conv2d backward (data) [1|0|3|fma,...] picked algo 1 math 1; ..."
  awk 'BEGIN { split("f32 f64 f16 bf16", names, " ") }
       {
         dir = ($5 ~ /^\(/) ? $4 " " $5 : $4
         match($0, /\[[0-9]+\|[0-9]+\|[0-9]+\|/); split(substr($0, RSTART + 1, RLENGTH - 2), key, "|")
         dt = names[key[3] + 1]
         match($0, /picked algo [0-9]+ math [0-9]+/); n[dt " " dir ": " substr($0, RSTART + 7, RLENGTH - 7)]++
       }
       END { for (k in n) printf "  %s: %d shapes\n", k, n[k] }' "$CONV_LOG" | sort | tee -a "$WORK/table.txt"
fi
copy_out "$CONV_LOG"

# ------------------------------------------------- collectives on the device

# Two ranks on the one GPU, 4 KiB to 64 MiB: device buffers with the staged
# reduction on the device and on the host, next to host buffers.
ALLREDUCE_LOG="$WORK/allreduce.log"
: >"$ALLREDUCE_LOG"
begin_phase "benchmark: all-reduce on device buffers, 2 ranks"
ALLREDUCE_ARGS=(--nproc_per_node=2 --max_bytes=67108864 --iters=10 --staged_reduce=both)
if [ "$SKIP_COLLECTIVES" = 1 ]; then
  end_phase "skipped (--skip-collectives)"
elif [ "$DRY_RUN" = 1 ]; then
  echo "dry run: would run: ${ALLREDUCE_BIN:-(no binary)} ${ALLREDUCE_ARGS[*]}"
  end_phase "skipped (dry run)"
elif [ -z "$ALLREDUCE_BIN" ] || [ ! -x "$ALLREDUCE_BIN" ]; then
  echo "gpu_check: no all-reduce benchmark binary (${ALLREDUCE_BIN:-neither bazel nor a bundle})"
  end_phase "FAILED (not built)"
else
  UCX_LOG_LEVEL=error run_logged "$(phase_limit 60 60)" "$ALLREDUCE_LOG" "${OUR_ENV[@]}" "$ALLREDUCE_BIN" \
    "${ALLREDUCE_ARGS[@]}"
  end_phase "$(describe_rc $?)"
fi
copy_out "$ALLREDUCE_LOG"

# ------------------------------------------------------ kernel profile (ncu)

# One timed step per mode under Nsight Compute, the kernels' durations only
# (one replay pass each); --profiler_range limits it to the timed step.
PROFILE_LOG="$WORK/profile.txt"
if [ "$PROFILE" = 1 ]; then
  : >"$PROFILE_LOG"
  begin_phase "profile: kernel times of one training step (ncu), modes $PROFILE_MODES"
  NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  NCU_ARGS=(--profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --print-units base)
  STEP_ARGS=(--model=resnet50 "--batch=$BATCH" --warmup=2 --steps=1 --profiler_range)
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: would run: ${NCU:-ncu} ${NCU_ARGS[*]} ${BENCH_BIN:-(no benchmark binary)} ${STEP_ARGS[*]} --modes=MODE"
    end_phase "skipped (dry run)"
  elif [ -z "$NCU" ]; then
    end_phase "skipped (no ncu)"
  elif [ -z "$BENCH_BIN" ] || [ ! -x "$BENCH_BIN" ]; then
    end_phase "FAILED (no benchmark binary)"
  else
    rc=0
    for m in "${PROFILE_MODE_LIST[@]}"; do
      limit="$(phase_limit 90 60)"
      if [ "$limit" -lt "$MIN_PHASE_S" ]; then
        echo "+ not started (out of budget): $NCU ... --modes=$m"
        [ "$rc" = 0 ] && rc=$NOT_STARTED
        break
      fi
      echo "+ (limit ${limit}s) $NCU ... $BENCH_BIN ${STEP_ARGS[*]} --modes=$m"
      # ncu itself runs with the machine's libraries; only the profiled
      # binary gets ours (OUR_ENV: env with LD_LIBRARY_PATH, which execs it
      # in the same process).
      limited "$limit" "$NCU" "${NCU_ARGS[@]}" "${OUR_ENV[@]}" "$BENCH_BIN" "${STEP_ARGS[@]}" \
        "--modes=$m" >"$WORK/ncu_$m.csv" 2>&1
      r=$?
      {
        echo "== $m: $(grep -m1 '^BENCH' "$WORK/ncu_$m.csv" | grep -o 'batch=[0-9]*') one timed step (ncu exit $r)"
        timeout 30 "$PYTHON" tools/bench/ncu_summary.py --top=25 "$WORK/ncu_$m.csv" 2>&1
        echo
      } | tee -a "$PROFILE_LOG"
      [ "$r" = 0 ] || rc=$r
    done
    end_phase "$(describe_rc "$rc")"
  fi
  copy_out "$PROFILE_LOG"
fi

# ------------------------------------------------------------------ gpu tests

TEST_SUMMARY="$WORK/tests.txt"
: >"$TEST_SUMMARY"

# Appends a failed test's log (its end, when long) to $OUT/failed_tests.log:
# one file, because only a few files come back from a GPU machine's $OUT.
keep_failed_log() {
  local label=$1 log=$2
  [ -n "${OUT:-}" ] && [ -f "$log" ] || return 0
  local lines block
  lines=$(wc -l <"$log")
  # Built aside, then appended in one go: tests that run in parallel call
  # this as each ends, so that a run killed at its limit keeps what failed.
  block="$(mktemp "$WORK/failed.XXXXXX")"
  {
    # The first failures name the cause; the end says what failed.
    if [ "$lines" -le 600 ]; then
      echo "===== $label ($lines lines)"
      cat "$log"
    else
      echo "===== $label ($lines lines; the first 250 and the last 350)"
      head -n 250 "$log"
      echo "[... $((lines - 600)) lines left out ...]"
      tail -n 350 "$log"
    fi
  } >"$block"
  cat "$block" >>"$OUT/failed_tests.log"
  rm -f "$block"
}

run_tests_bazel() {
  local limit=$1 build_limit
  build_limit=$(phase_limit $((limit * 2 / 3)) 30)
  local common=(--config=cuda --keep_going --test_tag_filters=gpu "--test_timeout=$TEST_TIMEOUT_S"
    --test_output=summary --test_summary=terse "--local_test_jobs=$TEST_JOBS")
  run_logged "$build_limit" "$WORK/tests.log" bazel build --config=cuda --keep_going --build_tag_filters=gpu --build_tests_only //...
  run_logged "$(phase_limit "$limit" 25)" "$WORK/tests.log" bazel test "${common[@]}" //...
  local rc=$?
  # Bazel's verdict per test, as "//label VERDICT" lines.
  awk '$1 ~ /^\/\// && match($0, /(PASSED|FLAKY|TIMEOUT|NO STATUS|FAILED TO BUILD|FAILED)/) {
         print $1, substr($0, RSTART, RLENGTH) }' "$WORK/tests.log" | sort -u -k1,1 >"$TEST_SUMMARY"
  local testlogs label rel
  testlogs="$(bazel info --config=cuda bazel-testlogs 2>/dev/null)"
  awk '$2 != "PASSED" {print $1}' "$TEST_SUMMARY" | while read -r label; do
    rel="${label#//}"
    keep_failed_log "$label" "$testlogs/${rel/://}/test.log"
  done
  return "$rc"
}

# One bundled test under its deadline; writes "//label VERDICT" to $WORK/results/NAME.
run_one_bundled_test() {
  local name=$1 label=$2 limit=$3 rc verdict args=()
  [ -f "$BUNDLE_ROOT/args/$name" ] && mapfile -t args <"$BUNDLE_ROOT/args/$name"
  mkdir -p "$WORK/tmp/$name"
  TEST_TMPDIR="$WORK/tmp/$name" TEST_SRCDIR="$BUNDLE_ROOT/runfiles" TEST_WORKSPACE=ddp \
    UCX_LOG_LEVEL=error limited "$limit" \
    "${OUR_ENV[@]}" "$BUNDLE_ROOT/bin/$name" "${args[@]}" >"$WORK/testlogs/$name.log" 2>&1
  rc=$?
  case "$rc" in
    0) verdict=PASSED ;;
    124 | 137) verdict="TIMEOUT (${limit}s)" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  echo "$label $verdict" | tee "$WORK/results/$name"
  [ "$rc" = 0 ] || keep_failed_log "$label" "$WORK/testlogs/$name.log"
}

# The bundle's tests, TEST_JOBS at a time (as bazel would run them), each
# under --test-timeout and never past the phase's deadline.
run_tests_bundle() {
  local limit=$1 deadline name label left pids=()
  deadline=$(($(now) + limit))
  mkdir -p "$WORK/testlogs" "$WORK/results"
  while read -r name label; do
    # Polls rather than `wait -n`: a bare wait would also wait for the tee
    # that copies the output into $OUT, which never ends before the script.
    while [ "$(jobs -rp | wc -l)" -ge "$TEST_JOBS" ]; do sleep 0.5; done
    left=$((deadline - $(now)))
    # A test started with seconds left would only time out, which says
    # nothing about it: it needs a minute (or its whole timeout, if less).
    if [ "$left" -lt "$((TEST_TIMEOUT_S < 60 ? TEST_TIMEOUT_S : 60))" ]; then
      echo "$label NO STATUS (out of time)" >"$WORK/results/$name"
      continue
    fi
    [ "$left" -gt "$TEST_TIMEOUT_S" ] && left=$TEST_TIMEOUT_S
    echo "+ (limit ${left}s) $label"
    run_one_bundled_test "$name" "$label" "$left" &
    pids+=($!)
  done <"$BUNDLE_ROOT/tests.txt"
  [ "${#pids[@]}" -gt 0 ] && wait "${pids[@]}"
  sort "$WORK/results"/* >"$TEST_SUMMARY"
  local worst=0
  while read -r name label; do
    if ! grep -q "^$label PASSED\$" "$WORK/results/$name"; then
      worst=1
      echo "---- $(cat "$WORK/results/$name"): the end of its log"
      [ -f "$WORK/testlogs/$name.log" ] && tail -n 15 "$WORK/testlogs/$name.log"
    fi
  done <"$BUNDLE_ROOT/tests.txt"
  return "$worst"
}

begin_phase "gpu tests (timeout ${TEST_TIMEOUT_S}s each, keep going)"
if [ "$SKIP_TESTS" = 1 ]; then
  end_phase "skipped (--skip-tests)"
elif [ "$DRY_RUN" = 1 ]; then
  if [ "$TEST_RUNNER" = bundle ]; then
    echo "dry run: would run the $(wc -l <"$BUNDLE_ROOT/tests.txt") bundled tests, $TEST_JOBS at a time"
  else
    echo "dry run: would run: bazel test --config=cuda --keep_going --test_tag_filters=gpu --test_timeout=$TEST_TIMEOUT_S //..."
  fi
  end_phase "skipped (dry run)"
elif [ -z "$TEST_RUNNER" ]; then
  end_phase "FAILED (neither bazel nor a bundle)"
else
  if [ "$TEST_RUNNER" = bazel ]; then
    run_tests_bazel "$(phase_limit 400 5)"
  else
    run_tests_bundle "$(phase_limit 400 5)"
  fi
  rc=$?
  end_phase "$(describe_rc "$rc")"
fi

# -------------------------------------------------------------------- summary

summary | tee "$WORK/summary.txt"
copy_out "$WORK/summary.txt"

# Non-zero when any phase failed or timed out (skipped phases do not count).
status=0
for r in "${PHASE_RESULTS[@]}"; do
  case "$r" in FAILED* | "TIMED OUT"*) status=1 ;; esac
done
# Lets the tee into $OUT/gpu_check.log write its last lines before the exit.
if [ -n "${TEE_PID:-}" ]; then
  exec >&- 2>&-
  wait "$TEE_PID"
fi
exit "$status"
