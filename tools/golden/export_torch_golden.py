#!/usr/bin/python3
"""Exports golden values from PyTorch for nn/'s tests (run by hand).

Usage: /usr/bin/python3 tools/golden/export_torch_golden.py [OUT_DIR]
(default OUT_DIR: nn/testdata/golden next to this script's repository root).

Writes two small JSON files that //nn:golden_test compares against:
  layers.json  - inputs, outputs and gradients of single layers (f32):
                 for each case, loss = sum(y * r) with a fixed random r, and
                 the gradients of every input and parameter.
  training.json - 5 SGD steps (lr 0.05, momentum 0.9) of the peers' CNN on a
                 fixed batch: the loss of every step and, per parameter, its
                 sum, sum of squares and 64 sampled values after training.
                 Weights and inputs come from closed-form formulas, so the C++
                 side builds the same starting point without a weight file.
A tensor is {"shape": [...], "data": [row-major values]}. PyTorch is needed
only to run this script, never to build or test.
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def f32(v):
    """v rounded to 9 significant digits: enough to get the same f32 back, half the text of repr."""
    return float("%.9g" % v)


def enc(t):
    t = t.detach().to(torch.float64).contiguous()
    return {"shape": list(t.shape), "data": [f32(v) for v in t.reshape(-1).tolist()]}


def rand(*shape):
    return torch.rand(*shape, dtype=torch.float32) * 2 - 1


def layer_case(fn, inputs, params=()):
    """Runs fn(*inputs), backpropagates sum(y * r); returns everything encoded."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    y = fn(*leaves)
    r = rand(*y.shape)
    (y * r).sum().backward()
    case = {"r": enc(r), "y": enc(y)}
    for i, (x, leaf) in enumerate(zip(inputs, leaves)):
        case[f"x{i}"] = enc(x)
        case[f"dx{i}"] = enc(leaf.grad)
    for name, p in params:
        case[name] = enc(p)
        case["d" + name] = enc(p.grad)
    return case


def module_case(module, x):
    x = x.clone()
    case = layer_case(module, [x], list(module.named_parameters()))
    for name, b in module.named_buffers():
        case["after_" + name] = enc(b)
    return case


def layers():
    out = {}
    lin = nn.Linear(5, 3)
    out["linear"] = module_case(lin, rand(4, 5))
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
    out["conv_s2p1"] = module_case(conv, rand(2, 3, 7, 7))
    conv = nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2)
    out["conv_dilated_grouped"] = module_case(conv, rand(2, 4, 6, 6))
    conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    out["conv_wide"] = module_case(conv, rand(2, 8, 9, 9))
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(rand(3))
        bn.bias.copy_(rand(3))
    out["batchnorm2d_train"] = module_case(bn, rand(4, 3, 5, 5))
    bn.eval()
    out["batchnorm2d_eval"] = module_case(bn, rand(4, 3, 5, 5))
    bn1 = nn.BatchNorm1d(6)
    out["batchnorm1d_train"] = module_case(bn1, rand(8, 6))
    out["maxpool_2"] = module_case(nn.MaxPool2d(2), rand(2, 3, 9, 8))
    out["maxpool_3s2p1_ceil"] = module_case(nn.MaxPool2d(3, 2, 1, ceil_mode=True), rand(2, 3, 8, 7))
    out["avgpool_3s2p1_nopad"] = module_case(nn.AvgPool2d(3, 2, 1, count_include_pad=False), rand(2, 3, 8, 7))
    out["avgpool_2"] = module_case(nn.AvgPool2d(2), rand(2, 3, 6, 6))
    out["adaptive_avgpool_3x2"] = module_case(nn.AdaptiveAvgPool2d((3, 2)), rand(2, 3, 7, 5))
    out["gelu"] = module_case(nn.GELU(), rand(3, 7) * 3)
    out["gelu_tanh"] = module_case(nn.GELU(approximate="tanh"), rand(3, 7) * 3)
    out["sigmoid"] = module_case(nn.Sigmoid(), rand(3, 7) * 3)
    out["tanh"] = module_case(nn.Tanh(), rand(3, 7) * 3)
    out["log_softmax"] = module_case(nn.LogSoftmax(dim=1), rand(4, 6) * 3)
    logits = rand(6, 5) * 3
    target = torch.tensor([0, 4, 2, 2, 1, 3])
    for name, kwargs in [("cross_entropy", {}), ("cross_entropy_smooth", {"label_smoothing": 0.1}),
                         ("cross_entropy_sum", {"reduction": "sum"})]:
        leaf = logits.clone().requires_grad_(True)
        loss = F.cross_entropy(leaf, target, **kwargs)
        loss.backward()
        out[name] = {"x0": enc(logits), "target": [int(v) for v in target], "y": enc(loss), "dx0": enc(leaf.grad)}
    a, b = rand(4, 5), rand(4, 5)
    la = a.clone().requires_grad_(True)
    loss = F.mse_loss(la, b)
    loss.backward()
    out["mse"] = {"x0": enc(a), "x1": enc(b), "y": enc(loss), "dx0": enc(la.grad)}
    # Appended last, so that the cases above draw the same random values as
    # before. Two values per channel and image, four per channel in all: the
    # running variance's unbiased factor 4/3 is far outside the tolerance.
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(rand(3))
        bn.bias.copy_(rand(3))
    out["batchnorm2d_train_small"] = module_case(bn, rand(2, 3, 1, 2))
    return out


def formula(shape, salt, scale):
    """scale * sin(0.7 * i + salt) over the flat index i (computed in f64, stored f32)."""
    n = math.prod(shape)
    i = torch.arange(n, dtype=torch.float64)
    return (scale * torch.sin(0.7 * i + salt)).to(torch.float32).reshape(shape)


def training():
    net = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(), nn.Linear(128, 10))
    with torch.no_grad():
        for k, (name, p) in enumerate(net.named_parameters()):
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            p.copy_(formula(p.shape, float(k), 1.0 / math.sqrt(fan_in)))
    n = 16
    i = torch.arange(n * 784, dtype=torch.float64)
    x = (0.5 + 0.5 * torch.sin(0.013 * i)).to(torch.float32).reshape(n, 1, 28, 28)
    y = torch.arange(n) % 10
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    params = {}
    for name, p in net.named_parameters():
        flat = p.detach().to(torch.float64).reshape(-1)
        idx = [int(k * flat.numel() / 64) for k in range(64)]
        params[name] = {"shape": list(p.shape), "sum": float(flat.sum()), "sumsq": float((flat * flat).sum()),
                        "index": idx, "values": [float(flat[k]) for k in idx]}
    return {"batch": n, "losses": losses, "params": params,
            "recipe": "weights: scale*sin(0.7*i + k) with scale 1/sqrt(fan_in), k the parameter's position; "
                      "x = 0.5 + 0.5*sin(0.013*i) over [16, 1, 28, 28]; labels i % 10; SGD lr 0.05 momentum 0.9"}


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "nn", "testdata", "golden")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"torch_version": torch.__version__}
    for name, data in [("layers.json", layers()), ("training.json", training())]:
        data["_meta"] = meta
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(path + ".tmp", path)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
