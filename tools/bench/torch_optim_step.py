#!/usr/bin/python3
"""PyTorch's optimizer step on the parameters nn/optim/optim_bench.cc uses
(16 x 1.6M f32, one thread), for a side-by-side ratio in one run:

    bazel run //nn/optim:optim_bench && /usr/bin/python3 tools/bench/torch_optim_step.py
"""
import statistics
import time

import torch

torch.set_num_threads(1)


def run(name, make):
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(16):
        p = torch.randn(1600000, generator=g).requires_grad_()
        p.grad = torch.randn(1600000, generator=g)
        params.append(p)
    opt = make(params)
    opt.step()
    times, cpu = [], []
    with torch.no_grad():
        for _ in range(10):
            t0, c0 = time.perf_counter(), time.thread_time()
            opt.step()
            cpu.append((time.thread_time() - c0) * 1e3)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    cpu.sort()
    print("%-10s wall median %7.2f ms  min %7.2f ms  cpu min %7.2f ms  (torch %s)" %
          (name, statistics.median(times), times[0], cpu[0], torch.__version__))


run("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4))
run("adam", lambda p: torch.optim.Adam(p))
run("adamw", lambda p: torch.optim.AdamW(p))
run("adadelta", lambda p: torch.optim.Adadelta(p))
