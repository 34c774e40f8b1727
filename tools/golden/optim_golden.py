#!/usr/bin/python3
"""Exports PyTorch optimizer trajectories, LR schedules and gradient clipping
as golden data for nn/optim's tests. Run by hand (PyTorch is never a build
dependency):

    /usr/bin/python3 tools/golden/optim_golden.py > nn/optim/testdata/optim_golden.json
    /usr/bin/python3 tools/golden/optim_golden.py --schedulers > nn/optim/testdata/scheduler_golden.json

To add or refresh some cases without touching the others (whose values
would move if another torch build regenerated them), name them:

    /usr/bin/python3 tools/golden/optim_golden.py --update nn/optim/testdata/optim_golden.json \
        rmsprop rmsprop_groups ...

which recomputes only those "optimizers" and "param_groups" cases and writes
the file back with every other entry as it was.

The first file's "param_groups" and "group_schedules" hold optimizers and
schedulers over several parameter groups (PyTorch's param_groups). The
second file holds the schedulers added later (MultiStepLR, ExponentialLR,
LambdaLR, OneCycleLR, CosineAnnealingWarmRestarts, ReduceLROnPlateau), kept
apart so that regenerating it leaves the optimizer trajectories untouched;
its "momentum_cycles" (OneCycleLR with cycle_momentum, PyTorch's default)
hold optimizer trajectories whose momentum or beta1 the scheduler drives.
"""
import json
import math
import sys

import torch

STEPS = 12


def follow(opt, params, g, dtype, none_grad_at):
    """Steps opt STEPS times with random gradients from g (none for
    parameter i at step s when none_grad_at == (s, i)); returns the
    gradients and the parameters after each step."""
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
    return grads, after


def trajectory(name, make, dtype=torch.float32, none_grad_at=None):
    g = torch.Generator().manual_seed(1234)
    params = [torch.randn(3, 4, generator=g, dtype=dtype).requires_grad_(),
              torch.randn(5, generator=g, dtype=dtype).requires_grad_()]
    init = [p.detach().flatten().tolist() for p in params]
    opt = make(params)
    grads, after = follow(opt, params, g, dtype, none_grad_at)
    return {"name": name, "dtype": str(dtype).replace("torch.", ""),
            "defaults": {k: v for k, v in opt.defaults.items()
                         if isinstance(v, (int, float, bool, tuple))},
            "init": init, "shapes": [list(p.shape) for p in params],
            "grads": grads, "after": after}


def our_options(options):
    """A param group's PyTorch options under the names nn/optim's ParamGroup
    takes: betas as beta1 and beta2, flags as 0 or 1."""
    out = {}
    for k, v in options.items():
        if k == "betas":
            out["beta1"], out["beta2"] = v
        elif isinstance(v, bool):
            out[k] = 1 if v else 0
        else:
            out[k] = v
    return out


def group_trajectory(name, make, groups, none_grad_at=None):
    """A trajectory of make(param_groups) over three parameters split into
    groups: `groups` lists, per group, its parameters' indices and the
    options it overrides."""
    g = torch.Generator().manual_seed(4321)
    params = [torch.randn(3, 4, generator=g).requires_grad_(),
              torch.randn(5, generator=g).requires_grad_(),
              torch.randn(2, 3, generator=g).requires_grad_()]
    init = [p.detach().flatten().tolist() for p in params]
    opt = make([dict(params=[params[i] for i in idx], **options) for idx, options in groups])
    grads, after = follow(opt, params, g, torch.float32, none_grad_at)
    return {"name": name,
            "defaults": {k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, bool, tuple))},
            "groups": [{"params": idx, "options": our_options(options)} for idx, options in groups],
            "init": init, "shapes": [list(p.shape) for p in params], "grads": grads, "after": after}


def group_optimizers():
    optim = torch.optim
    return [
        # Another lr, weight decay and momentum in the second group.
        group_trajectory("sgd_momentum_groups", lambda g: optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=1e-3),
                         [([0], {}), ([1, 2], {"lr": 0.01, "weight_decay": 0.1, "momentum": 0.5,
                                               "dampening": 0.2})],
                         none_grad_at=(3, 1)),
        # maximize in one group only.
        group_trajectory("sgd_maximize_group", lambda g: optim.SGD(g, lr=0.05),
                         [([0, 2], {}), ([1], {"maximize": True, "lr": 0.02})]),
        # The usual AdamW split: no decay for biases and norms.
        group_trajectory("adamw_no_decay_group", lambda g: optim.AdamW(g, lr=1e-2, weight_decay=0.1),
                         [([0, 2], {}), ([1], {"weight_decay": 0.0})]),
        group_trajectory("adam_groups", lambda g: optim.Adam(g, lr=1e-2, amsgrad=True),
                         [([1], {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}), ([0], {}),
                          ([2], {"lr": 3e-2})],
                         none_grad_at=(5, 0)),
        group_trajectory("adadelta_groups", lambda g: optim.Adadelta(g, lr=0.5),
                         [([0, 1], {"rho": 0.95, "eps": 1e-5}), ([2], {"lr": 1.0, "weight_decay": 0.1})]),
        # An empty group (PyTorch allows it too).
        group_trajectory("sgd_empty_group", lambda g: optim.SGD(g, lr=0.1, momentum=0.9),
                         [([0, 1, 2], {}), ([], {"lr": 0.5})]),
        # centered and momentum zero-or-not are the same in every group (one
        # slot layout); the momentum's value, alpha, eps and lr are not.
        group_trajectory("rmsprop_groups", lambda g: optim.RMSprop(g, lr=1e-2, momentum=0.9, centered=True),
                         [([0, 2], {"alpha": 0.9, "eps": 1e-6, "weight_decay": 0.05}),
                          ([1], {"lr": 3e-3, "momentum": 0.5, "maximize": True})],
                         none_grad_at=(4, 2)),
        # lr, lr_decay, weight_decay and eps per group. torch fills every
        # sum with the constructor's initial_accumulator_value, a group's own
        # unread (nn/optim takes the group's), so no group overrides it here.
        group_trajectory("adagrad_groups", lambda g: optim.Adagrad(g, lr=0.1, initial_accumulator_value=0.2),
                         [([1], {"lr_decay": 0.05, "weight_decay": 0.1}),
                          ([0, 2], {"lr": 0.03, "eps": 1e-6})],
                         none_grad_at=(2, 0)),
    ]


def adagrad_state_at_start():
    """torch's Adagrad makes its sum when it is built: the state_dict of one
    that has not stepped (per parameter its step and sum), and the
    trajectory of a second Adagrad, made with another
    initial_accumulator_value, that loads it and then steps."""
    g = torch.Generator().manual_seed(2468)
    params = [torch.randn(3, 4, generator=g).requires_grad_(),
              torch.randn(5, generator=g).requires_grad_()]
    init = [p.detach().flatten().tolist() for p in params]
    saver = torch.optim.Adagrad(params, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.25)
    saved = saver.state_dict()
    state = [{"step": float(saved["state"][i]["step"]), "sum": saved["state"][i]["sum"].flatten().tolist()}
             for i in range(len(params))]
    loader = torch.optim.Adagrad(params, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.0)
    loader.load_state_dict(saved)
    grads, after = follow(loader, params, g, torch.float32, None)
    return {"name": "adagrad_state_at_start",
            "defaults": {k: v for k, v in saver.defaults.items() if isinstance(v, (int, float, bool, tuple))},
            "init": init, "shapes": [list(p.shape) for p in params], "state_before_first_step": state,
            "grads": grads, "after": after}


def group_schedules():
    """Each case: per step, the rate of each of two SGD groups (lr 0.1 and
    0.03) before the first step, then after each of `steps` scheduler steps."""
    S = torch.optim.lr_scheduler
    out = []

    def run(name, make, steps=25):
        p, q = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.03}], lr=0.1)
        sched = make(opt)
        lrs = [[group["lr"] for group in opt.param_groups]]
        for _ in range(steps):
            opt.step()
            sched.step()
            lrs.append([group["lr"] for group in opt.param_groups])
        out.append({"name": name, "base_lrs": [0.1, 0.03], "lrs": lrs})

    run("step", lambda o: S.StepLR(o, step_size=3, gamma=0.5))
    run("cosine", lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=0.001))
    run("onecycle_cos", lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=30, cycle_momentum=False), steps=30)

    plateau = []
    p, q = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.05}], lr=1.0)
    # min_lr stops the second group first; eps then keeps it from moving by
    # less than eps while the first still falls.
    options = dict(patience=1, factor=0.5, min_lr=0.01, eps=0.005)
    sched = S.ReduceLROnPlateau(opt, **options)
    metrics = [5.0 - 0.01 * (i % 2) for i in range(30)]
    lrs = []
    for m in metrics:
        opt.step()
        sched.step(m)
        lrs.append([group["lr"] for group in opt.param_groups])
    plateau.append({"name": "two_groups_min_lr_eps", "base_lrs": [1.0, 0.05], "options": options,
                    "metrics": metrics, "lrs": lrs})
    return {"schedules": out, "plateau": plateau}


def lr_trace(name, make, steps):
    """The rate of an SGD at lr 0.1 before the first step, then after each
    of `steps` steps of the scheduler make(optimizer)."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    sched = make(opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return {"name": name, "base_lr": 0.1, "lrs": lrs}


def schedules():
    out = []

    def run(name, make, steps=25):
        out.append(lr_trace(name, make, steps))

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


def more_schedules():
    """Each case: the lr before the first step, then after each of `steps`
    scheduler steps, from an SGD at lr 0.1."""
    S = torch.optim.lr_scheduler
    out = []

    def run(name, make, steps=30):
        out.append(lr_trace(name, make, steps))

    run("multistep", lambda o: S.MultiStepLR(o, milestones=[3, 7, 7, 20], gamma=0.5))
    run("exponential", lambda o: S.ExponentialLR(o, gamma=0.9))
    # The C++ test passes the same two functions.
    run("lambda_pow", lambda o: S.LambdaLR(o, lambda e: 0.95 ** e))
    run("lambda_warmup", lambda o: S.LambdaLR(o, lambda e: min(1.0, (e + 1) / 8)))
    # cycle_momentum=False: the C++ OneCycleSchedule drives the rate only.
    # PyTorch allows one step more than total_steps - 1, past the last phase's
    # end: the cos cases climb back there, the linear ones go below zero (a
    # rate the C++ optimizer refuses), so those stop one step short.
    run("onecycle_cos", lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=30, cycle_momentum=False), steps=30)
    run("onecycle_linear", lambda o: S.OneCycleLR(o, max_lr=0.5, total_steps=25, pct_start=0.4,
                                                  anneal_strategy="linear", div_factor=10,
                                                  final_div_factor=100, cycle_momentum=False), steps=24)
    run("onecycle_three_phase", lambda o: S.OneCycleLR(o, max_lr=2.0, total_steps=40, pct_start=0.25,
                                                       three_phase=True, cycle_momentum=False), steps=40)
    run("onecycle_three_phase_linear", lambda o: S.OneCycleLR(o, max_lr=0.3, total_steps=17, pct_start=0.3,
                                                              anneal_strategy="linear", three_phase=True,
                                                              cycle_momentum=False), steps=16)
    run("warm_restarts", lambda o: S.CosineAnnealingWarmRestarts(o, T_0=5, eta_min=0.001), steps=40)
    run("warm_restarts_mult", lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.0), steps=60)
    run("warm_restarts_mult3", lambda o: S.CosineAnnealingWarmRestarts(o, T_0=1, T_mult=3, eta_min=0.01), steps=60)

    plateau = []

    def run_plateau(name, metrics, **kwargs):
        p = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([p], lr=1.0)
        sched = S.ReduceLROnPlateau(opt, **kwargs)
        lrs = []
        for m in metrics:
            opt.step()
            sched.step(m)
            lrs.append(opt.param_groups[0]["lr"])
        kwargs = dict(kwargs)
        plateau.append({"name": name, "base_lr": 1.0, "options": kwargs, "metrics": metrics, "lrs": lrs})

    down_then_flat = [10 - i for i in range(6)] + [4.9999, 5.0, 4.5, 4.5, 4.4999] + [4.0 + 0.01 * (i % 3)
                                                                                    for i in range(30)]
    run_plateau("min_rel_defaults", down_then_flat)
    run_plateau("min_rel_patience2", down_then_flat, patience=2, factor=0.5)
    run_plateau("min_abs_cooldown", down_then_flat, patience=1, factor=0.3, threshold=0.1,
                threshold_mode="abs", cooldown=2)
    up = [float(i % 7) + 0.1 * i for i in range(40)]
    run_plateau("max_rel_min_lr", up, mode="max", patience=0, factor=0.5, threshold=0.05, min_lr=0.1)
    run_plateau("max_abs_eps", up, mode="max", patience=1, factor=0.9, threshold=0.5, threshold_mode="abs",
                min_lr=0.5, eps=0.06, cooldown=1)
    # Equal metrics are no improvement at threshold 0; steady gains smaller
    # than an absolute threshold are none either.
    run_plateau("min_rel_zero_threshold", [3.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.5] * 2, patience=2,
                factor=0.5, threshold=0.0)
    run_plateau("max_abs_small_gains", [0.1 * i for i in range(20)], mode="max", patience=1, factor=0.5,
                threshold=0.25, threshold_mode="abs")
    run_plateau("min_nan", [1.0, float("nan"), 2.0, 0.5, float("nan"), float("nan"), 0.4, 0.3] * 3,
                patience=1, factor=0.5)
    return {"torch_version": torch.__version__, "schedules": out, "plateau": plateau}


def momentum_cycle(name, make_opt, groups, make_sched, steps):
    """An optimizer over two parameters in `groups` (per group: its
    parameters' indices and the options it overrides) driven by the
    OneCycleLR make_sched(optimizer) with cycle_momentum: per group, the
    rate and the momentum (SGD's momentum, Adam's beta1) after construction
    and after each of `steps` steps, with the gradients and the parameters
    after each optimizer step."""
    g = torch.Generator().manual_seed(2468)
    params = [torch.randn(3, 4, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()]
    init = [p.detach().flatten().tolist() for p in params]
    opt = make_opt([dict(params=[params[i] for i in idx], **options) for idx, options in groups])
    sched = make_sched(opt)

    def momenta():
        return [group["betas"][0] if "betas" in group else group["momentum"] for group in opt.param_groups]

    lrs, moms, grads, after = [[group["lr"] for group in opt.param_groups]], [momenta()], [], []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        grads.append([p.grad.flatten().tolist() for p in params])
        opt.step()
        after.append([p.detach().flatten().tolist() for p in params])
        sched.step()
        lrs.append([group["lr"] for group in opt.param_groups])
        moms.append(momenta())
    return {"name": name,
            "defaults": {k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, bool, tuple))},
            "groups": [{"params": idx, "options": our_options(options)} for idx, options in groups],
            "init": init, "shapes": [list(p.shape) for p in params], "grads": grads, "after": after,
            "lrs": lrs, "momenta": moms}


def momentum_cycles():
    """OneCycleLR with cycle_momentum (PyTorch's default): the C++ test
    makes the same schedules by name."""
    S = torch.optim.lr_scheduler
    optim = torch.optim
    return [
        # Two SGD groups with their own momentum (overwritten by the
        # scheduler's) and lr (ignored: OneCycle gives every group its rate).
        momentum_cycle("sgd_momentum_two_groups",
                       lambda g: optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=1e-3),
                       [([0], {}), ([1], {"lr": 0.03, "momentum": 0.5, "dampening": 0.1})],
                       lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=20), steps=20),
        # AdamW: beta1 is cycled, between other momenta.
        momentum_cycle("adamw_beta1",
                       lambda g: optim.AdamW(g, lr=1e-2, weight_decay=0.1),
                       [([0], {}), ([1], {"weight_decay": 0.0, "betas": (0.7, 0.99)})],
                       lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=16, pct_start=0.4,
                                              base_momentum=0.8, max_momentum=0.9), steps=16),
        # Three phases, linear, with Nesterov: stopped one step short of the
        # end, where the linear rate goes below zero.
        momentum_cycle("sgd_nesterov_three_phase_linear",
                       lambda g: optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
                       [([0, 1], {})],
                       lambda o: S.OneCycleLR(o, max_lr=0.3, total_steps=24, pct_start=0.25, three_phase=True,
                                              anneal_strategy="linear", base_momentum=0.75,
                                              max_momentum=0.92), steps=23),
        momentum_cycle("adam_three_phase",
                       lambda g: optim.Adam(g, lr=1e-3, amsgrad=True),
                       [([1], {}), ([0], {"eps": 1e-6})],
                       lambda o: S.OneCycleLR(o, max_lr=0.02, total_steps=30, pct_start=0.2, three_phase=True),
                       steps=30),
        # PyTorch's list forms: a peak rate and a momentum pair per group.
        momentum_cycle("sgd_per_group_lists",
                       lambda g: optim.SGD(g, lr=0.1, momentum=0.9),
                       [([0], {}), ([1], {"lr": 0.03})],
                       lambda o: S.OneCycleLR(o, max_lr=[0.2, 0.05], total_steps=18, pct_start=0.4,
                                              base_momentum=[0.8, 0.7], max_momentum=[0.9, 0.95]), steps=18),
        momentum_cycle("adamw_per_group_max_lr_three_phase",
                       lambda g: optim.AdamW(g, lr=1e-2, weight_decay=0.05),
                       [([1], {}), ([0], {"weight_decay": 0.0})],
                       lambda o: S.OneCycleLR(o, max_lr=[0.01, 0.04], total_steps=21, three_phase=True,
                                              anneal_strategy="linear", max_momentum=[0.93, 0.9]), steps=20),
    ]


def main():
    if sys.argv[1:] == ["--schedulers"]:
        # NaN metrics are written as null: JSON has no NaN.
        data = more_schedules()
        data["momentum_cycles"] = momentum_cycles()
        for c in data["plateau"]:
            c["metrics"] = [None if math.isnan(m) else m for m in c["metrics"]]
        print(json.dumps(data))
        return

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
        trajectory("rmsprop", lambda p: optim.RMSprop(p)),
        trajectory("rmsprop_momentum_wd", lambda p: optim.RMSprop(p, lr=1e-2, alpha=0.9, eps=1e-6, momentum=0.9,
                                                                  weight_decay=0.01), none_grad_at=(3, 1)),
        trajectory("rmsprop_centered", lambda p: optim.RMSprop(p, lr=1e-2, centered=True)),
        trajectory("rmsprop_centered_momentum_maximize",
                   lambda p: optim.RMSprop(p, lr=5e-3, alpha=0.95, momentum=0.8, centered=True, weight_decay=0.1,
                                           maximize=True)),
        trajectory("rmsprop_f64", lambda p: optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
                   dtype=torch.float64),
        trajectory("adagrad", lambda p: optim.Adagrad(p)),
        trajectory("adagrad_lr_decay_wd_init", lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                                                       initial_accumulator_value=0.5),
                   none_grad_at=(5, 0)),
        trajectory("adagrad_maximize", lambda p: optim.Adagrad(p, lr=0.05, eps=1e-6, maximize=True)),
        trajectory("adagrad_f64", lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.02, initial_accumulator_value=0.1),
                   dtype=torch.float64),
    ]
    cases.append(adagrad_state_at_start())
    groups = group_optimizers()
    if sys.argv[1:2] == ["--update"]:
        update(sys.argv[2], sys.argv[3:], cases, groups)
        return
    print(json.dumps({"torch_version": torch.__version__, "optimizers": cases,
                      "schedules": schedules(), "clipping": clipping(),
                      "param_groups": groups, "group_schedules": group_schedules()}))


def update(path, names, cases, groups):
    """Rewrites `path` with the cases `names` (from `cases` and `groups`)
    recomputed or appended, every other entry kept as it was."""
    if not names:
        sys.exit("--update: name the cases to recompute")
    with open(path) as f:
        data = json.load(f)
    if data["torch_version"] != torch.__version__:
        sys.exit(f"--update: {path} was made by torch {data['torch_version']}, this is {torch.__version__}")
    for key, fresh in (("optimizers", cases), ("param_groups", groups)):
        by_name = {c["name"]: c for c in fresh}
        for name in names:
            if name not in by_name:
                continue
            old = [i for i, c in enumerate(data[key]) if c["name"] == name]
            if old:
                data[key][old[0]] = by_name[name]
            else:
                data[key].append(by_name[name])
    known = {c["name"] for c in cases} | {c["name"] for c in groups}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"--update: no case named {', '.join(unknown)}")
    with open(path, "w") as f:
        f.write(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
