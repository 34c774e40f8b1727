#!/usr/bin/env python3
"""Where a training step's GPU time goes, from an Nsight Compute CSV.

Input: the output of
    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        --print-units base <program> ...
(ncu's own "==PROF==" lines and the program's output may be mixed in; only
the quoted CSV rows are read). Output: the number of kernels, their summed
GPU time, the share of this project's kernels (namespace ddp::) and the
largest groups of kernels by time, a group being one kernel function (its
template arguments and parameters dropped).

    python3 tools/bench/ncu_summary.py ncu_fp32.csv [--top=20]
"""
import argparse
import collections
import csv
import re
import sys

METRIC = "gpu__time_duration.sum"


def _max_depth(name):
    depth = deepest = 0
    for ch in name:
        if ch == "<":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ">":
            depth -= 1
    return deepest


def group_name(kernel):
    """The kernel's function with its outer template arguments: no parameter
    list, no return type, no nested signatures, lambdas or inner template
    arguments (ElementwiseKernel<float> and ElementwiseKernel<3, ddp::Binary>
    stay apart; the instances of one lambda do not)."""
    name = kernel.replace("::<unnamed>::", "::").replace("(anonymous namespace)::", "")
    # Drop the parameter list: the last top-level "(...)".
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        if name[i] == ")":
            depth += 1
        elif name[i] == "(":
            depth -= 1
            if depth == 0:
                name = name[:i]
                break
    # Lambdas and the signatures of functions named inside template arguments.
    while True:
        stripped = re.sub(r"::\[lambda[^\[\]]*\]|\([^()]*\)", "", name)
        if stripped == name:
            break
        name = stripped
    # Inner template arguments, innermost first, down to one level.
    while _max_depth(name) > 1:
        name = re.sub(r"(<[^<>]*)<[^<>]*>", r"\1", name, count=1)
    name = re.sub(r"^void ", "", name.strip())
    return name if len(name) <= 110 else name[:107] + "..."


def read_rows(lines):
    quoted = [line for line in lines if line.startswith('"')]
    if not quoted:
        raise SystemExit("ncu_summary: no CSV rows (was ncu run with --csv?)")
    reader = csv.DictReader(quoted)
    missing = {"Kernel Name", "Metric Name", "Metric Value", "Metric Unit"} - set(reader.fieldnames or ())
    if missing:
        raise SystemExit("ncu_summary: the CSV has no column %s" % ", ".join(sorted(missing)))
    for row in reader:
        if row["Metric Name"] != METRIC:
            continue
        unit = row["Metric Unit"]
        scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}.get(unit)
        if scale is None:
            raise SystemExit("ncu_summary: unknown time unit %r (run ncu with --print-units base)" % unit)
        yield row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale


def summarize(rows, top):
    time_ms = collections.Counter()
    count = collections.Counter()
    ours_ms = 0.0
    for kernel, ms in rows:
        g = group_name(kernel)
        time_ms[g] += ms
        count[g] += 1
        if "ddp::" in kernel:
            ours_ms += ms
    total = sum(time_ms.values())
    kernels = sum(count.values())
    out = ["%d kernels, %.2f ms of GPU time" % (kernels, total)]
    if total > 0:
        out.append("this project's kernels (ddp::): %.2f ms (%.1f%%); libraries' (cuDNN, cuBLAS): %.2f ms (%.1f%%)"
                   % (ours_ms, 100 * ours_ms / total, total - ours_ms, 100 * (total - ours_ms) / total))
    out.append("%9s %6s %6s  %s" % ("ms", "%", "calls", "kernel"))
    for g, ms in time_ms.most_common(top):
        out.append("%9.2f %6.1f %6d  %s" % (ms, 100 * ms / total if total else 0, count[g], g))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu's CSV output (or - for stdin)")
    p.add_argument("--top", type=int, default=20, help="groups to list (default 20)")
    args = p.parse_args()
    if args.top < 1:
        p.error("--top must be at least 1")
    if args.csv == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(args.csv) as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise SystemExit("ncu_summary: cannot read %s: %s" % (args.csv, e.strerror))
    print(summarize(read_rows(lines), args.top))


if __name__ == "__main__":
    main()
