#!/usr/bin/python3
"""PyTorch's side of nn/cuda/train_step_bench: whole training steps (forward,
cross-entropy, backward, SGD with momentum) of ResNet-50 with the CIFAR stem
on synthetic 3x32x32 images, eager mode, printing the same BENCH line per
precision mode so that tools/gpu_check.sh can put the two side by side.

    python3 tools/bench/torch_train_step_bench.py --modes=fp32,bf16,fp16
    python3 tools/bench/torch_train_step_bench.py --device=cpu --batch=4 --warmup=1 --steps=1

The model is defined here (torchvision may be missing) with torchvision's
structure and initialization, which nn/modules/models.cc follows too:
Bottleneck blocks with the stride on the 3x3 convolution, 1x1 projection
shortcuts with batch norm, convolutions without bias. The CIFAR stem is a
3x3/1 convolution and no max-pool.

Settings match the C++ benchmark: TF32 off for matmul and convolution unless
--tf32 (PyTorch allows it for cuDNN by default; our default is off), cuDNN
algorithm search on (ours searches once per shape too), SGD lr 0.01,
momentum 0.9, weight decay 5e-4, gradients set to None each step. Modes:
fp32; bf16 (autocast, f32 master weights, no scaler); fp16 (autocast and
GradScaler).
"""
import argparse
import contextlib
import json
import math
import os
import struct
import sys
import time
import traceback

import torch
from torch import nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes, planes, stride):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_planes != out:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet50Cifar(nn.Module):

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        in_planes = 64
        for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(in_planes, planes, 2 if stage > 0 and b == 0 else 1))
                in_planes = planes * Bottleneck.expansion
            setattr(self, "layer%d" % (stage + 1), nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


MODES = ("fp32", "bf16", "fp16")


def make_scaler(device_type, enabled):
    # torch.amp.GradScaler(device) exists from 2.3; older releases have the CUDA one only.
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device_type, enabled=enabled)
    if device_type != "cuda":
        raise SystemExit("torch_train_step_bench: mode fp16 needs torch.amp.GradScaler (PyTorch >= 2.3) on %s" %
                         device_type)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def load_safetensors(path):
    """The tensors of a safetensors file, on the CPU (the format: an 8-byte
    little-endian header length, a JSON header, then the raw data)."""
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = dtypes[info["dtype"]]
        if begin == end:
            out[name] = torch.empty(info["shape"], dtype=dtype)
        else:
            out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(info["shape"])
    return out


def run_mode(args, mode, device):
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = ResNet50Cifar().to(device).train()
    images = torch.randn(args.batch, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (args.batch,), device=device)
    if args.load_init:
        # Our benchmark's start (--save_init): the same weights and batch.
        state = load_safetensors(args.load_init)
        images = state.pop("input.images").to(device)
        labels = state.pop("input.labels").to(device)
        if images.shape[0] != args.batch:
            raise SystemExit("--load_init: the saved batch has %d images, --batch is %d" %
                             (images.shape[0], args.batch))
        model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    scaler = make_scaler(device.type, mode == "fp16") if mode == "fp16" else None

    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with autocast:
            loss = F.cross_entropy(model(images), labels)
        if args.print_loss:
            print("LOSS impl=torch mode=%s step=%d loss=%.6f" % (mode, len(losses), loss.item()), flush=True)
            losses.append(loss.item())
        if args.optimizer == "none":
            loss.backward()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    scale_before = scaler.get_scale() if scaler else 1.0
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start
    final_loss = loss.item()
    # The scale halves after each skipped step and grows only after 2000 good
    # ones: the count comes from it, with no host read inside the timed loop.
    skipped = round(math.log2(scale_before / scaler.get_scale())) if scaler else 0
    if final_loss != final_loss or final_loss in (float("inf"), float("-inf")):
        raise SystemExit("torch_train_step_bench: mode %s: the loss is %r after the timed steps" % (mode, final_loss))
    print("BENCH impl=torch model=resnet50 mode=%s batch=%d warmup=%d steps=%d optimizer=%s tf32=%s "
          "images_per_s=%.1f ms_per_step=%.2f final_loss=%.4f skipped_steps=%d params=%d device=%s torch=%s" %
          (mode, args.batch, args.warmup, args.steps, args.optimizer, "on" if args.tf32 else "off",
           args.batch * args.steps / seconds, 1e3 * seconds / args.steps, final_loss, skipped,
           sum(p.numel() for p in model.parameters()), device,
           torch.__version__),
          flush=True)
    if device.type == "cuda":
        print("  %s: peak device memory allocated %.1f MiB" % (mode, torch.cuda.max_memory_allocated(device) / 2**20),
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (cpu: a smoke test of this script)")
    p.add_argument("--modes", default="fp32", help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--optimizer", choices=("sgd", "none"), default="sgd",
                   help="none: forward and backward only")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for f32 matmul and convolution")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--load_init", default="",
                   help="start from the weights and batch that our benchmark wrote with --save_init")
    p.add_argument("--print_loss", action="store_true",
                   help="print a LOSS line after every step (waits for the device: timing not comparable)")
    args = p.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            p.error("--modes: unknown mode %r (known: %s)" % (m, ", ".join(MODES)))
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch and --steps must be >= 1 and --warmup >= 0")
    if args.load_init and not os.path.isfile(args.load_init):
        p.error("--load_init: no file %s" % args.load_init)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("torch_train_step_bench: --device=%s but torch.cuda.is_available() is False (torch %s)" %
                     (args.device, torch.__version__))
        # The caching allocator's statistics (reset per mode) exist only once
        # CUDA is initialized on the device: reset_peak_memory_stats before
        # that fails with "Invalid device argument".
        torch.cuda.set_device(device)
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
        torch.backends.cudnn.benchmark = True
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    failed = []
    for m in modes:
        # A failing mode does not stop the next ones; the exit status says it failed.
        try:
            run_mode(args, m, device)
        except (RuntimeError, SystemExit) as e:
            print("torch_train_step_bench: mode %s failed: %s: %s" % (m, type(e).__name__, e), file=sys.stderr,
                  flush=True)
            if not isinstance(e, SystemExit):
                traceback.print_exc()
            failed.append(m)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
