"""Drop-in cases for ``HDETOptimizerParamScheduler``: each case builds Megatron's
``OptimizerParamScheduler`` and ours side by side on twin optimizers and compares them step by
step (param-group ``lr`` / ``weight_decay``, ``get_lr``, ``get_wd``, ``num_steps``, state dict).

The cases follow the scenarios of Megatron-LM's own scheduler unit tests (construction, weight
decay styles, LR decay styles, step, empty and overridden param groups, state dict save and load)
and add the ones a drop-in must also get right (WSD, inverse-square-root, tensor LRs, legacy
state-dict keys, the override / use-checkpoint rules). Ours runs with ``hdet=None`` and with a
one-arm neutral HDET config (spread 0 on ``lr`` and ``weight_decay``, controller untouched).

Used in-process without torch.distributed (``test_drop_in.py``) and on a gloo world with
Megatron's parallel_state initialized.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

#: The one-arm neutral config: HDET is on but changes no value.
NEUTRAL = HDETConfig(arms=1, axes=(Axis("lr", 0.0), Axis("weight_decay", 0.0)), period=7)
MODES = {"hdet=None": None, "neutral one-arm HDET": NEUTRAL}

BASE = dict(
    init_lr=0.01,
    max_lr=0.1,
    min_lr=0.001,
    lr_warmup_steps=100,
    lr_decay_steps=1000,
    lr_decay_style="linear",
    start_wd=0.0,
    end_wd=0.1,
    wd_incr_steps=1000,
    wd_incr_style="linear",
)


def _optimizer(groups):
    return SimpleNamespace(param_groups=copy.deepcopy(groups))


def _value(x):
    return float(x) if isinstance(x, torch.Tensor) else x


def _snapshot(sched, opt):
    groups = opt.param_groups
    return {
        "num_steps": sched.num_steps,
        "lr": [_value(g["lr"]) for g in groups],
        "weight_decay": [g["weight_decay"] for g in groups],
        "get_lr": [sched.get_lr(g) for g in groups],
        "get_wd": [sched.get_wd(), *[sched.get_wd(g) for g in groups]],
    }


def _megatron_state(state):
    return {k: v for k, v in state.items() if k != "hdet"}


def pair(hdet, groups=({"lr": 0.0, "weight_decay": 0.0},), **overrides):
    """(Megatron's scheduler, its optimizer, ours, its optimizer) with the same arguments."""
    kwargs = {**BASE, **overrides}
    ref_opt, our_opt = _optimizer(list(groups)), _optimizer(list(groups))
    ref = OptimizerParamScheduler(ref_opt, **kwargs)
    ours = HDETOptimizerParamScheduler(our_opt, hdet=hdet, **kwargs)
    return ref, ref_opt, ours, our_opt


def same_trace(hdet, increments, groups=({"lr": 0.0, "weight_decay": 0.0},), **overrides):
    """Step both by ``increments`` and assert every observable value is identical after each."""
    ref, ref_opt, ours, our_opt = pair(hdet, groups, **overrides)
    assert _snapshot(ours, our_opt) == _snapshot(ref, ref_opt), "after construction"
    for i, inc in enumerate(increments):
        ref.step(inc)
        ours.step(inc)
        assert _snapshot(ours, our_opt) == _snapshot(ref, ref_opt), f"step {i} (+{inc})"
        assert _megatron_state(ours.state_dict()) == ref.state_dict(), f"state after step {i}"
    return ref, ref_opt, ours, our_opt


# ------------------------------------------------------------------------------------------------
# The cases. Each takes ``hdet`` (None or NEUTRAL) and raises AssertionError on a difference.
# ------------------------------------------------------------------------------------------------


def case_initialization(hdet):
    ref, _, ours, _ = pair(hdet)
    for name in (
        "init_lr",
        "max_lr",
        "min_lr",
        "lr_warmup_steps",
        "lr_decay_steps",
        "lr_decay_style",
        "start_wd",
        "end_wd",
        "wd_incr_steps",
        "wd_incr_style",
        "num_steps",
        "override_opt_param_scheduler",
        "use_checkpoint_opt_param_scheduler",
    ):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.max_lr == 0.1 and ours.lr_decay_style == "linear" and ours.num_steps == 0


def case_weight_decay_styles(hdet):
    ref, _, ours, _ = same_trace(hdet, [500], start_wd=0.1, end_wd=0.1, wd_incr_style="constant")
    assert ours.get_wd() == 0.1
    _, _, ours, _ = same_trace(hdet, [500, 250, 300])  # linear, then past wd_incr_steps
    assert ours.get_wd() == 0.1
    _, _, ours, _ = same_trace(hdet, [500], lr_decay_style="cosine", wd_incr_style="cosine")
    assert math.isclose(ours.get_wd(), 0.05 * (math.cos(math.pi * 0.5) + 1.0), rel_tol=1e-9)
    ref, _, ours, _ = pair(hdet)
    ref.step(500)
    ours.step(500)
    assert ours.get_wd() == ref.get_wd() == 0.05


def case_lr_decay_styles(hdet):
    steps = [0, 1, 49, 50, 400, 1, 449, 100, 1, 50]
    group = {"max_lr": 0.1, "min_lr": 0.001}
    for style in ("linear", "cosine", "constant", "inverse-square-root"):
        ref, _, ours, _ = same_trace(hdet, steps, lr_decay_style=style)
        assert ours.get_lr(group) == ref.get_lr(group), style
    for wsd_style in ("linear", "cosine", "exponential", "minus_sqrt"):
        same_trace(hdet, steps, lr_decay_style="WSD", wsd_decay_steps=300, lr_wsd_decay_style=wsd_style)
    # The warm-up / decay / floor values of Megatron's own test, on ours.
    _, _, ours, _ = pair(hdet)
    ours.step(50)
    assert math.isclose(ours.get_lr(group), 0.01 + (0.1 - 0.01) * 0.5, rel_tol=1e-9)
    ours.step(450)
    assert math.isclose(ours.get_lr(group), 0.1 - (0.1 - 0.001) * (400 / 900), rel_tol=1e-9)
    ours.step(501)
    assert ours.get_lr(group) == 0.001
    _, _, ours, _ = pair(hdet, lr_decay_style="cosine")
    ours.step(500)
    expected = 0.001 + (0.1 - 0.001) * 0.5 * (math.cos(math.pi * 400 / 900) + 1.0)
    assert math.isclose(ours.get_lr(group), expected, rel_tol=1e-9)


def case_step_sets_param_groups(hdet):
    _, _, ours, opt = same_trace(hdet, [100])
    assert ours.num_steps == 100
    assert math.isclose(opt.param_groups[0]["lr"], 0.1, rel_tol=1e-12)
    assert math.isclose(opt.param_groups[0]["weight_decay"], 0.01, rel_tol=1e-12)


def case_empty_and_overridden_groups(hdet):
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    groups = (
        {"params": [1, 2], "min_lr": 0.001, "max_lr": 0.2, "default_config": False},
        {"params": [], "wd_mult": 0.0, "default_config": True},
        {"params": [3], "wd_mult": 0.5, "start_wd": 0.02, "end_wd": 0.04},
    )
    same_trace(hdet, [0, 100, 1, 400, 600], groups=groups)
    _, _, _, opt = same_trace(hdet, [100], groups=groups)
    non_empty, empty, _ = opt.param_groups
    assert math.isclose(non_empty["lr"], 0.2, rel_tol=1e-12) and math.isclose(empty["lr"], 0.1, rel_tol=1e-12)
    assert get_canonical_lr_for_logging(opt.param_groups) == empty["lr"]
    assert math.isclose(non_empty["weight_decay"], 0.01, rel_tol=1e-12) and empty["weight_decay"] == 0.0


def case_tensor_lr(hdet):
    groups = ({"lr": torch.tensor(0.0, dtype=torch.float64), "weight_decay": 0.0},)
    _, ref_opt, _, opt = same_trace(hdet, [0, 30, 70, 400], groups=groups)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert opt.param_groups[0]["lr"].item() == ref_opt.param_groups[0]["lr"].item()


def case_state_dict(hdet):
    ref, _, ours, _ = same_trace(hdet, [])
    state = ours.state_dict()
    assert _megatron_state(state) == ref.state_dict()
    assert ("hdet" in state) == (hdet is not None)
    assert state["num_steps"] == 0 and state["max_lr"] == 0.1 and state["wd_incr_style"] == "linear"


def case_load_state_dict(hdet):
    saved = {
        "max_lr": 0.2,
        "min_lr": 0.0005,
        "lr_warmup_steps": 200,
        "lr_decay_steps": 2000,
        "lr_decay_style": "cosine",
        "num_steps": 500,
        "start_wd": 0.01,
        "end_wd": 0.2,
        "wd_incr_steps": 500,
        "wd_incr_style": "cosine",
    }
    legacy = {
        "start_lr": 0.2,
        "min_lr": 0.0005,
        "warmup_iter": 200,
        "end_iter": 2000,
        "decay_style": "cosine",
        "num_iters": 500,
    }
    for state in (saved, legacy):
        ref, ref_opt, ours, opt = pair(hdet)
        ref.load_state_dict(dict(state))
        ours.load_state_dict(dict(state))
        assert _snapshot(ours, opt) == _snapshot(ref, ref_opt)
        for name in (
            "max_lr",
            "min_lr",
            "lr_warmup_steps",
            "lr_decay_steps",
            "lr_decay_style",
            "num_steps",
            "start_wd",
            "end_wd",
            "wd_incr_steps",
            "wd_incr_style",
        ):
            assert getattr(ours, name) == getattr(ref, name), name
        assert ours.num_steps == 500 and ours.lr_decay_style == "cosine"
        for inc in (1, 99, 1000):
            ref.step(inc)
            ours.step(inc)
            assert _snapshot(ours, opt) == _snapshot(ref, ref_opt)
    # Save in one, load in a fresh other: both directions give the same continuation.
    ref, ref_opt, ours, opt = same_trace(hdet, [150, 20])
    ref2, ref2_opt, ours2, opt2 = pair(hdet)
    ref2.load_state_dict(ref.state_dict())
    ours2.load_state_dict(ours.state_dict())
    assert _snapshot(ours2, opt2) == _snapshot(ref2, ref2_opt)


def case_override_and_checkpoint_rules(hdet):
    saved = dict(BASE, num_steps=300)
    saved = {
        k: saved[k]
        for k in (
            "max_lr",
            "min_lr",
            "lr_warmup_steps",
            "lr_decay_steps",
            "lr_decay_style",
            "num_steps",
            "start_wd",
            "end_wd",
            "wd_incr_steps",
            "wd_incr_style",
        )
    }
    saved["max_lr"] = 0.3
    # override: this run's values win; use-checkpoint (default): the checkpoint's win.
    for flags in ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": False}, {}):
        ref, ref_opt, ours, opt = pair(hdet, **flags)
        ref.load_state_dict(dict(saved))
        ours.load_state_dict(dict(saved))
        assert ours.max_lr == ref.max_lr and _snapshot(ours, opt) == _snapshot(ref, ref_opt)
    # Neither: a mismatch fails the same way as in Megatron.
    ref, _, ours, _ = pair(hdet, use_checkpoint_opt_param_scheduler=False)
    errors = []
    for sched in (ref, ours):
        try:
            sched.load_state_dict(dict(saved))
        except AssertionError as exc:
            errors.append(type(exc))
    assert errors == [AssertionError, AssertionError]
    # Both flags: refused at construction by both.
    refused = []
    for cls in (OptimizerParamScheduler, HDETOptimizerParamScheduler):
        kwargs = dict(BASE, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)
        if cls is HDETOptimizerParamScheduler:
            kwargs["hdet"] = hdet
        try:
            cls(_optimizer([{"lr": 0.0, "weight_decay": 0.0}]), **kwargs)
        except AssertionError:
            refused.append(cls.__name__)
    assert len(refused) == 2


def case_invalid_arguments(hdet):
    """Megatron's argument asserts hold for ours too (same exception type)."""
    for bad in (
        {"min_lr": -1.0},
        {"max_lr": 0.0005},
        {"init_lr": 0.5},
        {"lr_decay_steps": 0},
        {"lr_warmup_steps": 1000},
        {"start_wd": 0.2},
        {"lr_decay_style": "WSD"},
    ):
        outcome = []
        for cls in (OptimizerParamScheduler, HDETOptimizerParamScheduler):
            kwargs = {**BASE, **bad}
            if cls is HDETOptimizerParamScheduler:
                kwargs["hdet"] = hdet
            try:
                cls(_optimizer([{"lr": 0.0, "weight_decay": 0.0}]), **kwargs)
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - compare what each raises
                outcome.append(type(exc))
        assert outcome[0] is not None and outcome[0] == outcome[1], (bad, outcome)


CASES = [
    case_initialization,
    case_weight_decay_styles,
    case_lr_decay_styles,
    case_step_sets_param_groups,
    case_empty_and_overridden_groups,
    case_tensor_lr,
    case_state_dict,
    case_load_state_dict,
    case_override_and_checkpoint_rules,
    case_invalid_arguments,
]


def run_all() -> dict:
    """Every case in both modes; returns {"mode/case": "ok" or the failure} (for worlds)."""
    import traceback

    out = {}
    for mode, hdet in MODES.items():
        for case in CASES:
            try:
                case(hdet)
                out[f"{mode}/{case.__name__}"] = "ok"
            except Exception:  # noqa: BLE001 - reported back to the test
                out[f"{mode}/{case.__name__}"] = traceback.format_exc()
    return out


def world_cases(rank: int, world_size: int) -> dict:
    """:func:`run_all` on a gloo world with Megatron's parallel_state set up (TP = PP = 1, so the
    neutral config's one arm spans every DP rank)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        assert dist.is_initialized()
        return run_all()
    finally:
        ps.destroy_model_parallel()
