#!/usr/bin/python3
"""Peer baseline: PyTorch (Debian python3-torch) gloo send/recv ping-pong.

Usage: torch_gloo_p2p.py [sizes in bytes...]
Two ranks; rank 0 sends a float32 tensor, rank 1 sends it back. Prints, as
//ddp:p2p_bench does, one line per size: bytes one_way_us GBps (one-way =
half the mean round trip).
"""
import os, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, sizes, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    for nbytes in sizes:
        t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        iters = max(3, min(2000, int(2e8 // max(nbytes, 1))))

        def trip():
            if rank == 0:
                dist.send(t, peer, tag=1)
                dist.recv(t, peer, tag=1)
            else:
                dist.recv(t, peer, tag=1)
                dist.send(t, peer, tag=1)

        for _ in range(5):
            trip()
        t0 = time.perf_counter()
        for _ in range(iters):
            trip()
        one_way = (time.perf_counter() - t0) / iters / 2
        if rank == 0:
            print(f"{nbytes} {one_way * 1e6:.2f} {nbytes / one_way / 1e9:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sizes = [int(s) for s in sys.argv[1:]] or [8 * 8**k for k in range(8)]
    mp.spawn(worker, args=(sizes, 29500 + os.getpid() % 1000), nprocs=2)
