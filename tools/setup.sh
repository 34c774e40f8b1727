#!/usr/bin/env bash
# Installs every Debian package that the build, the tests and the default
# example need. Idempotent: when everything is present it only checks
# (no apt-get update) and finishes in well under a second.
#
# Peers used for comparisons (python3-torch, openmpi-bin) are not installed
# here: the product never depends on them. See ../shared/peers/README.md.
set -euo pipefail

PACKAGES=(
  # build
  bazel-bootstrap g++ make
  # transport
  libucx-dev ucx-utils libhwloc-dev
  # common libraries
  libgflags-dev libgoogle-glog-dev nlohmann-json3-dev zlib1g-dev
  # nn: BLAS (the pthread build, whose headers third_party/blas names: the
  # openmp or serial variant would also satisfy libopenblas-dev) and oneDNN
  libopenblas-dev libopenblas-pthread-dev libdnnl-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # fuzzing (--config=fuzz): clang and its libFuzzer and sanitizer runtimes
  clang libclang-rt-14-dev
  # multi-host tests (network namespaces; kmod's modprobe loads veth where
  # it is a module), process tools used by tests; python3 runs
  # //tools:ncu_summary_test and gpu_check.sh's table code; zip packs what
  # a test leaves in its undeclared outputs (Bazel's test wrapper)
  iproute2 kmod procps python3 zip
  # //examples:train_run_test renders the trainer's SVG chart to PNG
  chromium
  # the default example's dataset
  dataset-fashion-mnist
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii'; then
    missing+=("$p")
  fi
done

# The build is written for Debian's Bazel 4 (bazel-bootstrap: WORKSPACE,
# no Bzlmod, offline); another `bazel` first on PATH (bazelisk, Bazel 7/8)
# fails later with errors that never name the version.
check_bazel() {
  local found
  found=$(command -v bazel || true)
  if [ -z "$found" ] || [ "$(readlink -f "$found")" != "$(readlink -f /usr/bin/bazel)" ]; then
    echo "setup.sh: the build needs Debian's Bazel 4 (package bazel-bootstrap, /usr/bin/bazel), but" \
      "'bazel' on PATH is ${found:-missing}; put /usr/bin first on PATH" >&2
    exit 1
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  check_bazel
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else
    echo "setup.sh: missing packages (${missing[*]}) and not root; run as root" >&2
    exit 1
  fi
fi

echo "setup.sh: installing ${missing[*]}" >&2
# Through env: sudo resets the environment, and a debconf question asked
# with its output hidden would wait for ever. A mirror that does not answer
# gets three tries (apt-get update only warns, and the install then finds
# no package), and the dpkg lock, held by a timer's unattended run, up to
# 10 minutes; an install cut short earlier is finished first.
APT_OPTIONS=(-o Acquire::Retries=3 -o DPkg::Lock::Timeout=600)
for try in 1 2 3; do
  # Inside the tries: dpkg does not wait for its lock as apt-get does.
  if $SUDO env DEBIAN_FRONTEND=noninteractive dpkg --configure -a &&
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get "${APT_OPTIONS[@]}" update -qq &&
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get "${APT_OPTIONS[@]}" install -y -qq \
      --no-install-recommends "${missing[@]}" >/dev/null; then
    break
  fi
  if [ "$try" -eq 3 ]; then
    echo "setup.sh: apt-get could not install ${missing[*]} in three tries" >&2
    exit 1
  fi
  echo "setup.sh: apt-get failed (try $try of 3); trying again in 10 s" >&2
  sleep 10
done
check_bazel
echo "setup.sh: done" >&2
