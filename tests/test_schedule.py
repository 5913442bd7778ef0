"""hdet_megatron.schedule equals torch's OneCycleLR bit for bit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hdet_megatron.schedule import (
    OneCycleSchedule,
    anneal_cos,
    anneal_linear,
    onecycle_phases,
    phase_at,
)
from tests.onecycle_trace import toy_optimizer, trace_scheduler


def _torch_trace(kind, groups, total, **kw):
    lrs, moms, _ = trace_scheduler(torch.optim.lr_scheduler.OneCycleLR, kind, groups, total, **kw)
    return lrs, moms


CASES = [
    # (optimizer, groups, total_steps, kwargs)
    ("sgd", 1, 100, {"max_lr": 0.1}),
    ("sgd", 1, 37, {"max_lr": 0.3, "anneal_strategy": "linear"}),
    ("adam", 1, 100, {"max_lr": 1e-3, "three_phase": True}),
    ("adam", 1, 51, {"max_lr": 3e-4, "three_phase": True, "anneal_strategy": "linear", "pct_start": 0.25}),
    (
        "sgd",
        3,
        64,
        {
            "max_lr": [0.1, 0.02, 1.7],
            "base_momentum": [0.8, 0.85, 0.7],
            "max_momentum": 0.97,
            "pct_start": 0.4,
        },
    ),
    (
        "adam",
        2,
        80,
        {"max_lr": [2e-3, 7e-4], "div_factor": 10.0, "final_div_factor": 100.0, "three_phase": True},
    ),
    ("sgd", 1, 23, {"max_lr": 0.05, "pct_start": 0.0}),
    ("adam", 1, 19, {"max_lr": 0.05, "pct_start": 0.9, "anneal_strategy": "linear"}),
    ("sgd", 1, 1, {"max_lr": 0.5, "pct_start": 0.5}),
]


@pytest.mark.parametrize("kind,groups,total,kw", CASES)
def test_equals_torch_onecycle_bitwise(kind, groups, total, kw):
    lrs, moms = _torch_trace(kind, groups, total, **kw)
    sched = OneCycleSchedule(total_steps=total, num_groups=groups, **kw)
    for step in range(total + 1):
        assert sched.lrs(step) == lrs[step], step  # == on floats: bit-exact
        assert sched.momenta(step) == moms[step], step
        for g in range(groups):
            assert sched.lr(step, g) == lrs[step][g]
            assert sched.momentum(step, g) == moms[step][g]


def test_group_values_match_torch():
    opt = toy_optimizer("sgd", 2)
    torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[0.3, 0.07], total_steps=10, div_factor=7.0, final_div_factor=33.0
    )
    sched = OneCycleSchedule([0.3, 0.07], 10, div_factor=7.0, final_div_factor=33.0)
    assert sched.num_groups == 2
    for g, group in enumerate(opt.param_groups):
        for key in ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"):
            assert sched.groups[g][key] == group[key]
    assert sched.initial_lrs == [0.3 / 7.0, 0.07 / 7.0]
    assert sched.min_lrs == [0.3 / 7.0 / 33.0, 0.07 / 7.0 / 33.0]


def test_phase_table_is_torchs():
    for total, pct, three in itertools.product((10, 97), (0.3, 0.25), (False, True)):
        opt = toy_optimizer("sgd", 1)
        ref = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.1, total_steps=total, pct_start=pct, three_phase=three
        )
        assert onecycle_phases(total, pct, three) == ref._schedule_phases


def test_shape():
    s = OneCycleSchedule(1.0, 100, pct_start=0.3)
    assert s.lr(0) == pytest.approx(1.0 / 25.0, rel=1e-14)
    assert s.lr(29) == 1.0  # end of warm-up: peak
    assert s.lr(99) == pytest.approx(1.0 / 25.0 / 1e4)
    assert s.momentum(0) == 0.95 and s.momentum(29) == 0.85
    warm = [s.lr(t) for t in range(30)]
    decay = [s.lr(t) for t in range(29, 100)]
    assert warm == sorted(warm) and decay == sorted(decay, reverse=True)
    assert s.position(0) == (0, 0.0) and s.position(29) == (0, 1.0)
    phase, pct = s.position(64)
    assert phase == 1 and pct == pytest.approx(0.5)


def test_anneal_formulas():
    assert anneal_cos(2.0, 1.0, 0.0) == 2.0 and anneal_cos(2.0, 1.0, 1.0) == 1.0
    assert anneal_linear(2.0, 1.0, 0.5) == 1.5
    assert anneal_cos(0.1, 0.3, 0.37) == torch.optim.lr_scheduler.OneCycleLR._annealing_cos(0.1, 0.3, 0.37)
    assert anneal_linear(0.1, 0.3, 0.37) == torch.optim.lr_scheduler.OneCycleLR._annealing_linear(
        0.1, 0.3, 0.37
    )


def test_validation():
    with pytest.raises(ValueError, match="total_steps"):
        OneCycleSchedule(0.1, 0)
    with pytest.raises(ValueError, match="pct_start"):
        OneCycleSchedule(0.1, 10, pct_start=1.5)
    with pytest.raises(ValueError, match="anneal_strategy"):
        OneCycleSchedule(0.1, 10, anneal_strategy="exp")
    with pytest.raises(ValueError, match="one value per"):
        OneCycleSchedule([0.1, 0.2], 10, num_groups=3)
    s = OneCycleSchedule(0.1, 10)
    with pytest.raises(ValueError, match="Tried to step 11 times"):
        s.lr(11)
    with pytest.raises(ValueError, match=">= 0"):
        s.lr(-1)
    with pytest.raises(IndexError):
        s.lr(0, group=1)
    # A zero-length warm-up phase that is hit: torch divides 0 by 0, we say why.
    with pytest.raises(ValueError, match="zero length"):
        OneCycleSchedule(0.1, 10, pct_start=0.1).lr(0)
    with pytest.raises(ZeroDivisionError):
        torch.optim.lr_scheduler.OneCycleLR(toy_optimizer("sgd", 1), 0.1, total_steps=10, pct_start=0.1)


def test_phase_at_extrapolates_last_phase():
    phases = onecycle_phases(10)
    phase, pct = phase_at(phases, 10)
    assert phase is phases[-1] and pct > 1.0
    assert math.isfinite(OneCycleSchedule(0.1, 10).lr(10))
