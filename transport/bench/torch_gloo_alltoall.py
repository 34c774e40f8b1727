#!/usr/bin/python3
"""Peer baseline for the all-to-all comparison: PyTorch gloo
all_to_all_single on float32. Usage: torch_gloo_alltoall.py NPROC BYTES...
(each rank's whole send buffer). Rank 0 prints "bytes time_us" per size:
the slowest rank's mean time per call."""
import os, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, n, sizes, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for nbytes in sizes:
        block = max(1, nbytes // 4 // n)
        send = torch.ones(block * n, dtype=torch.float32)
        recv = torch.empty_like(send)
        iters = max(3, min(200, int(2e8 // (block * n * 4))))
        for _ in range(2):
            dist.all_to_all_single(recv, send)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_to_all_single(recv, send)
        dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.reduce(dt, 0, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{block * n * 4} {dt.item() * 1e6:.2f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    n = int(sys.argv[1])
    sizes = [int(s) for s in sys.argv[2:]]
    mp.spawn(worker, args=(n, sizes, 29500 + os.getpid() % 1000), nprocs=n)
