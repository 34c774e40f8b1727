#!/usr/bin/python3
"""Exports PyTorch optimizer trajectories, LR schedules and gradient clipping
as golden data for nn/optim's tests. Run by hand (PyTorch is never a build
dependency):

    /usr/bin/python3 tools/golden/optim_golden.py > nn/optim/testdata/optim_golden.json
"""
import json

import torch

STEPS = 12


def trajectory(name, make, dtype=torch.float32, none_grad_at=None):
    g = torch.Generator().manual_seed(1234)
    params = [torch.randn(3, 4, generator=g, dtype=dtype).requires_grad_(),
              torch.randn(5, generator=g, dtype=dtype).requires_grad_()]
    init = [p.detach().flatten().tolist() for p in params]
    opt = make(params)
    grads, after = [], []
    for step in range(STEPS):
        step_grads = []
        for i, p in enumerate(params):
            if none_grad_at == (step, i):
                p.grad = None
                step_grads.append(None)
            else:
                p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
                step_grads.append(p.grad.flatten().tolist())
        opt.step()
        grads.append(step_grads)
        after.append([p.detach().flatten().tolist() for p in params])
    return {"name": name, "dtype": str(dtype).replace("torch.", ""),
            "defaults": {k: v for k, v in opt.defaults.items()
                         if isinstance(v, (int, float, bool, tuple))},
            "init": init, "shapes": [list(p.shape) for p in params],
            "grads": grads, "after": after}


def schedules():
    out = []

    def run(name, make, steps=25):
        p = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        sched = make(opt)
        lrs = [opt.param_groups[0]["lr"]]
        for _ in range(steps):
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        out.append({"name": name, "base_lr": 0.1, "lrs": lrs})

    run("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5))
    run("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.001))
    run("linear", lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5))
    run("warmup_cosine", lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=15)], milestones=[5]))
    return out


def clipping():
    out = []
    g = torch.Generator().manual_seed(99)
    for max_norm, norm_type in ((1.0, 2.0), (100.0, 2.0), (0.5, float("inf"))):
        params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(7, requires_grad=True)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 3
        before = [p.grad.flatten().tolist() for p in params]
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        out.append({"max_norm": max_norm, "norm_type": "inf" if norm_type == float("inf") else norm_type,
                    "grads": before, "total_norm": total.item(),
                    "clipped": [p.grad.flatten().tolist() for p in params]})
    return out


def main():
    optim = torch.optim
    cases = [
        trajectory("sgd", lambda p: optim.SGD(p, lr=0.1)),
        trajectory("sgd_momentum", lambda p: optim.SGD(p, lr=0.05, momentum=0.9), none_grad_at=(3, 1)),
        trajectory("sgd_dampening_wd", lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                                           weight_decay=0.01)),
        trajectory("sgd_nesterov", lambda p: optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True,
                                                       weight_decay=1e-3)),
        trajectory("adam", lambda p: optim.Adam(p, lr=1e-2)),
        trajectory("adam_wd_amsgrad", lambda p: optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
                   none_grad_at=(5, 0)),
        trajectory("adam_f64", lambda p: optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
                   dtype=torch.float64),
        trajectory("adamw", lambda p: optim.AdamW(p, lr=1e-2)),
        trajectory("adamw_amsgrad", lambda p: optim.AdamW(p, lr=3e-2, weight_decay=0.05, amsgrad=True)),
        trajectory("adadelta", lambda p: optim.Adadelta(p)),
        trajectory("adadelta_wd", lambda p: optim.Adadelta(p, lr=0.5, rho=0.95, eps=1e-5, weight_decay=0.1)),
        trajectory("sgd_maximize", lambda p: optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01,
                                                       maximize=True), none_grad_at=(3, 1)),
        trajectory("adam_maximize", lambda p: optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True,
                                                         maximize=True)),
        trajectory("adamw_maximize", lambda p: optim.AdamW(p, lr=1e-2, maximize=True)),
        trajectory("adadelta_maximize", lambda p: optim.Adadelta(p, lr=0.5, weight_decay=0.1, maximize=True)),
    ]
    print(json.dumps({"torch_version": torch.__version__, "optimizers": cases,
                      "schedules": schedules(), "clipping": clipping()}))


if __name__ == "__main__":
    main()
