"""HDET checkpoint state in-process (no world): validation before mutation, resume rules.

The scheduler runs on a plain torch optimizer with an explicit :class:`ArmLayout`, so every rule
and every kind of corruption is checked in milliseconds; ``test_checkpointing.py`` repeats the
rules on real multi-rank Megatron checkpoints.
"""

from __future__ import annotations

import copy
import logging
import math
import os

import pytest
import torch

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron import checkpointing as ckpt
from hdet_megatron.megatron.checkpointing import HDETCheckpointError
from hdet_megatron.megatron.layout import ArmLayout
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
from hdet_megatron.spread import arm_spread

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

SCHED = dict(
    init_lr=0.0,
    max_lr=1e-3,
    min_lr=1e-4,
    lr_warmup_steps=2,
    lr_decay_steps=20,
    lr_decay_style="cosine",
    start_wd=0.01,
    end_wd=0.01,
    wd_incr_steps=20,
    wd_incr_style="constant",
)
CONFIG = HDETConfig(period=4, axes=(Axis("lr", 0.2),), temperature=0.05)


def layout(num_arms=2, dp_size=2, arm=1):
    per = dp_size // num_arms
    return ArmLayout(
        num_arms=num_arms,
        arm=arm,
        dp_size=dp_size,
        dp_rank=arm * per,
        replicas_per_arm=per,
        arm_ranks=(arm,),
        cross_arm_ranks=tuple(range(num_arms)),
        arm_group=None,
        cross_arm_group=None,
        loss_group=None,
        is_loss_reporter=True,
        is_last_stage=True,
    )


def scheduler(config=CONFIG, lay=None, **kwargs):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    return HDETOptimizerParamScheduler(opt, hdet=config, layout=lay or layout(), **SCHED, **kwargs)


def trained(steps=9, config=CONFIG):
    """A scheduler after a few windows with a moving controller."""
    s = scheduler(config)
    for window in range(2):
        s.step(4)
        s.controller.update([2.0, 1.5], s.arm_spread_values(), step=4 * (window + 1))
        s.set_window(s.window + 1)
    s.step(steps - 8)
    return s


def snapshot(s):
    return copy.deepcopy(s.state_dict()), s.optimizer.param_groups[0]["lr"], s.num_steps


def test_round_trip_restores_everything():
    a = trained()
    state = a.state_dict()
    assert set(state) >= set(OptimizerParamScheduler.state_dict(a)) | {"hdet"}
    hdet = state["hdet"]
    assert hdet["window"] == 2 and hdet["generator"] == {"seed": 0, "window": 2}
    resolved = CONFIG.resolve(probe_available=False, num_arms=2).config  # no HDET runtime, no probe
    assert hdet["num_arms"] == 2 and hdet["dp_size"] == 2 and hdet["config"] == resolved.fingerprint()
    assert hdet["controller"]["axes"]["lr"]["scale"] != 1.0
    b = scheduler()
    b.load_state_dict(copy.deepcopy(state))
    assert b.state_dict() == state
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert b.arm_spread_values() == a.arm_spread_values()


CORRUPTIONS = [
    (lambda h: h.pop("controller"), "['controller']: is missing"),
    (lambda h: h["controller"]["axes"]["lr"].update(scale="x"), "'x' must be a number"),
    (lambda h: h["controller"]["axes"]["lr"].update(scale=math.nan), "is not finite"),
    (lambda h: h["controller"]["axes"]["lr"].pop("velocity"), "missing key 'velocity'"),
    (lambda h: h["controller"].update(window=7), "['controller']['window']=7"),
    (lambda h: h.update(version=99), "['version']=99"),
    (lambda h: h.update(window=-1), "['window']=-1"),
    (lambda h: h["generator"].update(window=5), "['generator']"),
    (lambda h: h["runtime"].update(steps_in_window=4), "['runtime']['steps_in_window']=4"),
    (lambda h: h["runtime"].pop("iteration"), "['runtime']['iteration']"),
    (lambda h: h["runtime"].update(steps_in_window=1, arm_loss_sums=[1.0]), "arm_loss_sums"),
    (lambda h: h["config"].update(period=0), "is not a valid HDETConfig"),
    (lambda h: h.update(config="junk"), "['config']"),
    (lambda h: h.update(num_arms=3), "does not divide dp_size=2"),
]


@pytest.mark.parametrize("corrupt,message", CORRUPTIONS, ids=[m for _, m in CORRUPTIONS])
def test_corrupted_state_names_the_problem_and_changes_nothing(corrupt, message):
    state = trained().state_dict()
    state["hdet"]["runtime"] = {"iteration": 9, "steps_in_window": 1, "arm_loss_sums": [3.0, 2.5]}
    corrupt(state["hdet"])
    target = trained(steps=11)
    before = snapshot(target)
    with pytest.raises(HDETCheckpointError) as err:
        target.load_state_dict(state)
    assert message in str(err.value) and "nothing was loaded" in str(err.value)
    assert snapshot(target) == before


def test_non_dict_hdet_state():
    state = trained().state_dict()
    state["hdet"] = [1, 2]
    with pytest.raises(HDETCheckpointError, match="must be a dict"):
        scheduler().load_state_dict(state)


def test_plain_megatron_state_starts_at_scale_1():
    plain = OptimizerParamScheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), **SCHED)
    plain.step(6)
    s = scheduler()  # Megatron's load adds num_steps: it expects a fresh scheduler
    s.controller.update([2.0, 1.5], s.arm_spread_values(), step=4)
    s.set_window(1)
    assert s.controller.scales() != {"lr": 1.0}
    s.load_state_dict(plain.state_dict())
    assert s.controller.scales() == {"lr": 1.0} and s.controller.velocities() == {"lr": 0.0}
    assert s.window == 0 and s.controller.window == 0 and s.num_steps == 6
    # Megatron's LR after 6 steps x scale 1 x arm 1's multiplier in window 0.
    rho = arm_spread(CONFIG, 2, 0)["lr"][1]
    assert s.optimizer.param_groups[0]["lr"] == plain.optimizer.param_groups[0]["lr"] * 1.0 * rho != 0


def test_plain_scheduler_ignores_hdet_state_and_strip_warns_once(caplog):
    state = trained().state_dict()
    plain = OptimizerParamScheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), **SCHED)
    plain.load_state_dict(state)  # Megatron itself ignores the extra key
    assert plain.num_steps == 9
    ckpt._WARNED.discard("plain-scheduler")
    with caplog.at_level(logging.WARNING, logger="hdet_megatron"):
        for _ in range(3):
            assert "hdet" not in ckpt.strip_hdet_state(state)
    assert sum("ignored by this plain" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("num_arms,dp_size", [(1, 2), (4, 4)])
def test_layout_change_keeps_scale_restarts_window(num_arms, dp_size, caplog):
    a = trained()
    state = a.state_dict()
    state["hdet"]["runtime"] = {"iteration": 9, "steps_in_window": 1, "arm_loss_sums": [3.0, 2.5]}
    b = scheduler(lay=layout(num_arms, dp_size, arm=0))
    with caplog.at_level(logging.WARNING, logger="hdet_megatron"):
        b.load_state_dict(state)
    assert b.controller.scales() == a.controller.scales()
    assert b.controller.velocities() == a.controller.velocities()
    assert b.window == a.window
    pending = b.state_dict()["hdet"]["runtime"]
    assert pending == {"iteration": 9, "steps_in_window": 0, "arm_loss_sums": [0.0] * num_arms}
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "windows restarted" in text and "1 step(s) of the partial window are discarded" in text


def test_changed_config_checkpoint_wins_by_default():
    state = trained().state_dict()
    new = CONFIG.replace(period=6, meta_lr=0.1, grad_sync="arm")
    s = scheduler(new)
    s.load_state_dict(state)
    assert s.hdet_config.period == 4 and s.hdet_config.meta_lr == 0.5
    assert s.hdet_config.grad_sync == "arm"  # structural: always this run's
    assert s.controller.config is s.hdet_config


@pytest.mark.parametrize("how", ["attribute", "megatron_flag", "argument"])
def test_changed_config_override(how):
    state = trained().state_dict()
    new = CONFIG.replace(period=6)
    kwargs = {}
    if how == "megatron_flag":
        kwargs = dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    s = scheduler(new, **kwargs)
    kept = s.hdet_config  # ``new`` as this run resolved it
    assert kept.period == 6 and kept == new.resolve(probe_available=False, num_arms=2).config
    if how == "attribute":
        s.override_hdet_config = True
    if how == "argument":
        s.load_hdet_state_dict(state["hdet"], override=True)
    else:
        s.load_state_dict(state)
    assert s.hdet_config is kept
    assert s.controller.scales() == trained().controller.scales()


def test_changed_config_strict_mismatch_errors():
    state = trained().state_dict()
    s = scheduler(CONFIG.replace(period=6), use_checkpoint_opt_param_scheduler=False)
    before = snapshot(s)
    with pytest.raises(HDETCheckpointError, match="period: checkpoint 4 vs this run 6"):
        s.load_state_dict(state)
    assert snapshot(s) == before


def test_changed_axes_need_override():
    state = trained().state_dict()
    two = CONFIG.replace(axes=(Axis("lr", 0.2), Axis("weight_decay", 0.3)))
    with pytest.raises(HDETCheckpointError, match="axes cannot change"):
        scheduler(two).load_state_dict(state)
    s = scheduler(two)
    s.override_hdet_config = True
    s.load_state_dict(state)
    assert s.controller.scale("lr") == trained().controller.scale("lr")
    assert s.controller.scale("weight_decay") == 1.0


def test_saving_over_an_untracked_iteration_removes_only_checkpoint_files(tmp_path):
    """Before saving iteration N, an ``iter_N`` the tracker does not name (a save cut short) is
    removed, but only the files a save writes; anything else there stops the save before any file
    is removed (issue 27)."""
    root = tmp_path / "run"
    it = root / "iter_0000008"
    (it / "mp_rank_00_001").mkdir(parents=True)
    for name in (
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata.tmp",
        "mp_rank_00_001/model_optim_rng.pt.tmp",
        "mp_rank_00_001/distrib_optim_dp001.pt",
    ):
        (it / name).write_bytes(b"x")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    files, dirs = ckpt._untracked_checkpoint(str(root), 8, str(it))
    assert sorted(os.path.relpath(p, it) for p in files) == [
        ".metadata.tmp",
        "__0_0.distcp",
        "__1_0.distcp",
        os.path.join("mp_rank_00_001", "distrib_optim_dp001.pt"),
        os.path.join("mp_rank_00_001", "model_optim_rng.pt.tmp"),
    ]
    assert dirs == [str(it / "mp_rank_00_001"), str(it)]  # deepest first, the iteration last
    (root / "latest_checkpointed_iteration.txt").write_text("8")  # tracked: saved again in place
    assert ckpt._untracked_checkpoint(str(root), 8, str(it)) == ([], [])
    assert ckpt._untracked_checkpoint(str(root), 12, str(root / "iter_0000012")) == ([], [])
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    (it / "my_eval.json").write_text("mine")
    with pytest.raises(HDETCheckpointError, match=r"my_eval\.json is not a checkpoint file; nothing was"):
        ckpt._untracked_checkpoint(str(root), 8, str(it))
    (root / "iter_0000009").write_text("a file")
    with pytest.raises(HDETCheckpointError, match="is not a checkpoint directory"):
        ckpt._untracked_checkpoint(str(root), 9, str(root / "iter_0000009"))
    ckpt.remove_files(files, dirs[:1])  # what the save does on rank 0 (here: short of the stranger's dir)
    assert sorted(os.listdir(it)) == ["my_eval.json"]
