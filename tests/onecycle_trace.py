"""Shared by the OneCycle tests: a tiny optimizer and the per-step (lr, momentum) trace of a
OneCycle-style scheduler (torch's reference or ours) on it."""

from __future__ import annotations

import torch


def toy_optimizer(kind: str, groups: int) -> torch.optim.Optimizer:
    """SGD (momentum) or AdamW (betas) with ``groups`` param groups of one 2-vector each."""
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.99))


def trace_scheduler(sched_cls, kind: str, groups: int, total: int, extra=None, **kw):
    """Run ``total`` steps; return (per-step LRs per group, momenta or beta1 per group, sched)."""
    opt = toy_optimizer(kind, groups)
    sched = sched_cls(opt, total_steps=total, **kw, **(extra or {}))
    lrs, moms = [], []
    for step in range(total + 1):
        if step:
            opt.step()
            sched.step()
        lrs.append(list(sched.get_last_lr()))
        key = "betas" if kind == "adam" else "momentum"
        moms.append([g[key][0] if kind == "adam" else g[key] for g in opt.param_groups])
    return lrs, moms, sched
