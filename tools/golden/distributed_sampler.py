#!/usr/bin/python3
"""Exports index lists from PyTorch's samplers as golden data for
nn/data/sampler_test.cc. Run by hand (PyTorch is never a build dependency):

    /usr/bin/python3 tools/golden/distributed_sampler.py > nn/data/testdata/sampler_golden.json
"""
import json

import torch
from torch.utils.data import DistributedSampler


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def main():
    cases = []
    configs = []
    for n in (0, 1, 5, 10, 17, 100):
        for replicas in (1, 2, 3, 4, 7):
            for shuffle in (False, True):
                for drop_last in (False, True):
                    configs.append((n, replicas, shuffle, drop_last, 0, 0))
    # Seeds and epochs, a seed above 2^32 (PyTorch keeps its low 32 bits)
    # and Fashion-MNIST's size.
    for seed, epoch in ((42, 0), (42, 1), (42, 7), (2**32 + 3, 2)):
        configs.append((1000, 3, True, False, seed, epoch))
        configs.append((1000, 3, True, True, seed, epoch))
    configs.append((60000, 2, True, False, 0, 0))
    configs.append((60000, 2, True, False, 0, 1))
    for n, replicas, shuffle, drop_last, seed, epoch in configs:
        for rank in range(replicas):
            s = DistributedSampler(Sized(n), num_replicas=replicas, rank=rank,
                                   shuffle=shuffle, seed=seed, drop_last=drop_last)
            s.set_epoch(epoch)
            idx = list(s)
            if n == 60000:
                # Keep the file small: the first and last 50 indices and a
                # checksum of all of them.
                summary = {"head": idx[:50], "tail": idx[-50:],
                           "weighted_sum": sum((i + 1) * v for i, v in enumerate(idx))}
            else:
                summary = {"indices": idx}
            cases.append(dict(n=n, num_replicas=replicas, rank=rank, shuffle=shuffle,
                              drop_last=drop_last, seed=seed, epoch=epoch,
                              size=len(s), **summary))
    randperm = []
    for n, seed in ((1, 0), (2, 1), (10, 5), (1000, 123456789), (50000, 7)):
        g = torch.Generator()
        g.manual_seed(seed)
        p = torch.randperm(n, generator=g).tolist()
        randperm.append(dict(n=n, seed=seed, head=p[:64],
                             weighted_sum=sum((i + 1) * v for i, v in enumerate(p))))
    print(json.dumps({"torch_version": torch.__version__, "distributed": cases,
                      "randperm": randperm}, separators=(",", ":")))


if __name__ == "__main__":
    main()
