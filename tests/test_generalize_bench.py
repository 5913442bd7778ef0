"""The plumbing of ``benchmarks/generalize.py`` (issue 35's runner): argument parsing, the
held-out refusal, the sweep's bracketing, each row's command line and the table's formatting.
Nothing here trains; the rows fed to the table are made up to check its arithmetic, not results."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import generalize as g  # noqa: E402


def test_two_tuning_tasks_and_thirteen_held_out_on_two_paths():
    assert sorted(t.name for t in g.TASKS.values() if not t.held_out) == ["megatron-8x", "onecycle-ddp"]
    assert sorted(t.name for t in g.TASKS.values() if t.held_out) == [
        "ddp-long",
        "ddp-nowarm",
        "ddp-period25",
        "ddp-shortwu",
        "ddp-wide",
        "hsdp-cosine",
        "hsdp-longwu",
        "megatron-accum",
        "megatron-constant",
        "megatron-deep",
        "megatron-longwu",
        "megatron-wide",
        "megatron-wsd",
    ]
    assert {t.path for t in g.TASKS.values()} == {"megatron", "torch"}
    assert g.TASKS["hsdp-cosine"].options["fsdp"] == 1  # FSDP2 (the other torch tasks: DDP)
    assert g.TASKS["hsdp-longwu"].options["fsdp"] == 1
    for t in g.TASKS.values():
        assert t.steps % t.period == 0, t.name  # the last window ends at the last step


def test_default_tasks_are_the_tuning_tasks():
    args = g.parse_args([])
    assert args.tasks == ["megatron-8x", "onecycle-ddp"] and args.seeds == [1234]


# Every held-out task (the exact set is asserted above).
@pytest.mark.parametrize("task", sorted(name for name, task in g.TASKS.items() if task.held_out))
def test_held_out_tasks_are_refused_without_the_flag(task, capsys):
    with pytest.raises(SystemExit):
        g.parse_args(["--tasks", "onecycle-ddp", task])
    assert "held-out" in capsys.readouterr().err
    assert g.parse_args(["--tasks", task, "--held-out"]).tasks == [task]
    assert g.parse_args(["--tasks", task, "--table-only"]).table_only  # reading is not running


def test_sweep_extends_until_the_best_point_is_bracketed():
    assert g.next_sweep_factors({}) == list(g.SWEEP_FACTORS)
    inside = {0.25: 3.0, 0.5: 2.5, 1.0: 2.4, 2.0: 2.6, 4.0: 2.9}
    assert g.next_sweep_factors(inside) == []
    edge = {0.25: 3.0, 0.5: 2.5, 1.0: 2.4, 2.0: 2.3, 4.0: 2.2}
    assert g.next_sweep_factors(edge) == [8.0]
    assert g.next_sweep_factors({**edge, 8.0: 2.5}) == []


def test_rows_of_a_task():
    runs = g.method_runs(2e-3)
    assert [r.row for r in runs] == [
        "def-x0.25", "def-x1", "def-x4", "off-x0.25", "off-x1", "off-x4",
        "sf-x0.25", "sf-x1", "sf-x4", "prodigy",
    ]  # fmt: skip
    assert [r.lr for r in runs if r.group == "def"] == [5e-4, 2e-3, 8e-3]


def test_megatron_command_lines():
    task = g.TASKS["megatron-8x"]
    best = g.method_runs(2e-3)

    def cmd(row):
        return g.command(task, next(r for r in best if r.row == row), 1234, "PREFIX", 20)

    sweep = g.command(task, g.sweep_runs(task, [0.5])[0], 1234, "PREFIX", 20)
    assert sweep[0] == g.quality.SCRIPT and "--no-hdet" in sweep and "1e-3" not in sweep
    assert sweep[sweep.index("--lr") + 1] == "0.001" and sweep[sweep.index("--global-batch-size") + 1] == "64"
    d = cmd("def-x4")
    assert d[d.index("--hdet-period") + 1] == "10" and "--no-hdet-auto" not in d and "--no-hdet" not in d
    assert "--no-hdet-auto" in cmd("off-x1")
    sf = cmd("sf-x1")
    assert sf[:5] == [g.MEGATRON_LAUNCHER, "--peer", "sf", "--peer-warmup", "8"]
    # The last flag wins in argparse: Schedule-Free's LR is held constant by Megatron's scheduler.
    assert sf[len(sf) - 1 - sf[::-1].index("--lr-decay-style") + 1] == "constant"
    prodigy = cmd("prodigy")
    assert prodigy[prodigy.index("--lr") + 1] == "1" and prodigy[prodigy.index("--min-lr") + 1] == "0.1"
    wsd = g.command(g.TASKS["megatron-wsd"], g.sweep_runs(g.TASKS["megatron-wsd"], [1])[0], 1, "P", 20)
    assert wsd[len(wsd) - 1 - wsd[::-1].index("--lr-decay-style") + 1] == "WSD"


def test_torch_command_lines():
    task = g.TASKS["hsdp-cosine"]
    run = g.method_runs(3e-3)[0]
    c = g.command(task, run, 7, "unused", 20)
    assert c[0] == g.TORCH_WORKER and c[c.index("--mode") + 1] == "hdet"
    assert c[c.index("--fsdp") + 1] == "1" and c[c.index("--seed") + 1] == "7"
    assert c[c.index("--pct-start") + 1] == "0.05"
    modes = {r.group: g.command(task, r, 7, "", 20) for r in g.method_runs(3e-3)}
    assert modes["off"][modes["off"].index("--mode") + 1] == "hdet-off"
    assert modes["prodigy"][modes["prodigy"].index("--lr") + 1] == "1"


def _row(task, row, group, lr, loss, seed=1, guess=None):
    return {
        "task": task, "role": "tuning", "row": row, "group": group, "seed": seed, "lr": lr,
        "guess": guess, "valid_loss": loss, "final_scale": 1.0, "wall_seconds": 60.0,
    }  # fmt: skip


def test_table_formatting_against_the_best_sweep_point():
    rows = [
        _row("onecycle-ddp", "sweep-x0.5", "sweep", 2e-3, 2.2),
        _row("onecycle-ddp", "sweep-x1", "sweep", 4e-3, 2.0),
        _row("onecycle-ddp", "sweep-x2", "sweep", 8e-3, 2.1),
        _row("onecycle-ddp", "def-x0.5", "def", 2e-3, 2.02, guess=0.5),
        _row("onecycle-ddp", "prodigy", "prodigy", 1.0, 2.4),
    ]
    table = g.markdown_tables(rows)
    assert "#### onecycle-ddp (tuning)" in table
    assert "| **sweep x1** | 1 | 1 | 2.0000 (2.0000..2.0000) | +0.00% (+0.00..+0.00) |" in table
    # def at the x0.5 LR: +1% against the best point, plain at that LR +10%.
    assert "| def-x0.5 | 1 | 0.5 | 2.0200 (2.0200..2.0200) | +1.00% (+1.00..+1.00) | +10.00% |" in table
    assert "| prodigy | 1 | - | 2.4000" in table
    lines = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")]
    assert lines[1:] == ["| sweep x0.5", "| **sweep x1**", "| sweep x2", "| def-x0.5", "| prodigy"]
    # The LR a run trained at: the guess times the controller's median scale over its windows.
    rows[3]["median_scale"] = 3.0
    assert "| def-x0.5 | 1 | 0.5 | 2.0200 (2.0200..2.0200) | +1.00% (+1.00..+1.00) | +10.00% | 1.5 |" in (
        g.markdown_tables(rows)
    )


def test_prototype_rows_switch_the_prototypes_on_in_the_launchers(monkeypatch):
    # No prototype is open now (BENCHMARKS 3p); the launchers' switch is kept for the next one.
    monkeypatch.setitem(g.VARIANTS, "proto", g.Variant(("some_rule",)))
    runs = [r for r in g.method_runs(2e-3, ["proto"]) if r.group == "proto"]
    assert [r.row for r in runs] == ["proto-x0.25", "proto-x1", "proto-x4"]
    on = ["--prototype=some_rule"]
    torch_cmd = g.command(g.TASKS["onecycle-ddp"], runs[1], 1, "", 20)
    assert torch_cmd[torch_cmd.index("--mode") + 1] == "hdet" and torch_cmd[-1:] == on
    meg = g.command(g.TASKS["megatron-8x"], runs[1], 1, "P", 20)
    assert meg[:3] == [g.MEGATRON_LAUNCHER, *on, "--"] and meg[meg.index("--hdet-period") + 1] == "10"
    assert "--no-hdet-warmup-hold" not in meg and "--no-warmup-hold" not in torch_cmd
    monkeypatch.delitem(g.VARIANTS, "proto")
    for variant in g.VARIANTS.values():
        assert set(variant.prototypes) <= g_controller_known()


def test_nohold_rows_switch_the_warmup_hold_off_by_the_config_on_both_paths():
    nohold = next(r for r in g.method_runs(2e-3, ["nohold"]) if r.row == "nohold-x1")
    assert not nohold.variant.warmup_hold and not nohold.variant.prototypes
    torch_cmd = g.command(g.TASKS["onecycle-ddp"], nohold, 1, "", 20)
    assert torch_cmd[torch_cmd.index("--mode") + 1] == "hdet" and torch_cmd[-1] == "--no-warmup-hold"
    assert not any(c.startswith("--prototype") for c in torch_cmd)
    meg = g.command(g.TASKS["megatron-8x"], nohold, 1, "P", 20)
    assert meg[0] == g.quality.SCRIPT and "--no-hdet-warmup-hold" in meg  # the example's own flag
    assert not any(c.startswith("--prototype") for c in meg)
    # Both flags parse to HDETConfig(warmup_hold=False).
    import argparse

    import gen_torch

    from hdet_megatron.args import add_hdet_args

    assert not gen_torch.parse([*torch_cmd[1:], "--run-dir", "R"]).warmup_hold
    hdet_args, _ = add_hdet_args(argparse.ArgumentParser()).parse_known_args(meg[1:])
    assert not hdet_args.hdet_warmup_hold


def test_variant_rows_may_train_with_another_spread_or_auto_off():
    wline, offn = (
        next(r for r in g.method_runs(2e-3, [name]) if r.row == f"{name}-x1") for name in ("wline", "offn")
    )
    assert (wline.variant.spread, wline.variant.auto) == (0.05, True)
    assert (offn.variant.spread, offn.variant.auto) == (0.05, False)
    torch_cmd = g.command(g.TASKS["onecycle-ddp"], wline, 1, "", 20)
    assert torch_cmd[torch_cmd.index("--mode") + 1] == "hdet"
    assert torch_cmd[-2:] == ["--spread=0.05", "--line-width=0.3"]
    off_cmd = g.command(g.TASKS["onecycle-ddp"], offn, 1, "", 20)
    assert off_cmd[off_cmd.index("--mode") + 1] == "hdet-off" and off_cmd[-1] == "--spread=0.05"
    meg = g.command(g.TASKS["megatron-8x"], offn, 1, "P", 20)
    assert meg[0] == g.quality.SCRIPT  # no prototype: the example itself, not the launcher
    assert meg[meg.index("--hdet-spread") + 1] == "0.05" and meg[-1] == "--no-hdet-auto"
    meg = g.command(g.TASKS["megatron-8x"], wline, 1, "P", 20)
    assert meg[0] == g.quality.SCRIPT and not any(c.startswith("--prototype") for c in meg)
    assert meg[meg.index("--hdet-spread") + 1] == "0.05" and meg[meg.index("--hdet-line-width") + 1] == "0.3"
    plain = next(r for r in g.method_runs(2e-3, ["nohold"]) if r.group == "proto")
    assert "--hdet-spread" not in g.command(g.TASKS["megatron-8x"], plain, 1, "P", 20)


def g_controller_known() -> set[str]:
    from hdet_megatron.controller import KNOWN_PROTOTYPES

    return set(KNOWN_PROTOTYPES)


def test_fixed_rows_probe_without_moving_the_lr_on_both_paths():
    runs = [r for r in g.method_runs(2e-3, fixed=True) if r.group == "fixed"]
    assert [r.row for r in runs] == ["fixed-x0.25", "fixed-x1", "fixed-x4"]
    assert not any(r.group == "fixed" for r in g.method_runs(2e-3))
    mega = g.command(g.TASKS["megatron-8x"], runs[1], 1234, "PREFIX", 20)
    assert mega[0] == g.quality.SCRIPT and "--no-hdet-auto" not in mega and "--no-hdet-brake" in mega
    assert mega[mega.index("--hdet-meta-lr") + 1] == "0" and mega[mega.index("--hdet-start-scale") + 1] == "1"
    torch_cmd = g.command(g.TASKS["onecycle-ddp"], runs[2], 1, "", 20)
    assert torch_cmd[torch_cmd.index("--mode") + 1] == "hdet-fixed"
    assert float(torch_cmd[torch_cmd.index("--lr") + 1]) == 8e-3
    args = g.parse_args(["--fixed"])
    assert args.fixed and not g.parse_args([]).fixed


def test_signal_audit_train_slope_is_the_least_squares_slope_on_log_multiplier():
    import math

    import signal_audit

    multipliers = [1.3, 0.7, 0.9, 1.1]  # arm order, as logged
    window = {
        "arm_values": {"lr": multipliers},
        "arm_train_losses": [2.0 + 0.25 * math.log(m) for m in multipliers],
    }
    assert signal_audit.train_slope(window) == pytest.approx(0.25, abs=1e-12)
    assert math.isnan(signal_audit.train_slope({"arm_train_losses": [1.0] * 4}))
    assert math.isnan(signal_audit.train_slope({**window, "arm_train_losses": [1.0, math.inf, 1.0, 1.0]}))
    mean, se = signal_audit.mean_se([1.0, 3.0, math.nan])
    assert mean == 2.0 and se == pytest.approx(1.0)


def test_best_lr_from_an_earlier_sweep_needs_one_task_and_one_lr_per_seed(capsys):
    args = g.parse_args(["--tasks", "onecycle-ddp", "--seeds", "1", "2", "--best-lr", "2e-3", "4e-3"])
    assert args.best_lr == [2e-3, 4e-3]
    assert g.parse_args([]).best_lr is None  # the sweep runs by default
    for bad in (
        ["--tasks", "onecycle-ddp", "--seeds", "1", "2", "--best-lr", "2e-3"],
        ["--tasks", "onecycle-ddp", "megatron-8x", "--best-lr", "2e-3"],
        ["--tasks", "onecycle-ddp", "--best-lr", "0"],
    ):
        with pytest.raises(SystemExit):
            g.parse_args(bad)
        assert "--best-lr" in capsys.readouterr().err


def test_noise_floor_rows_and_their_pooled_spread():
    import noise_floor as nf

    assert nf.parse_best("onecycle-ddp:1234:2e-3:2.2108") == ("onecycle-ddp", 1234, 2e-3, 2.2108)
    for bad in ("onecycle-ddp:1234:2e-3", "no-task:1:1e-3:2.0", "onecycle-ddp:x:2e-3:2.0"):
        with pytest.raises(Exception, match="--best"):
            nf.parse_best(bad)

    def row(seed: int, factor: float, loss: float) -> dict:
        return {"task": "onecycle-ddp", "seed": seed, "factor": factor, "valid_loss": loss, "best_loss": 2.0}

    # Seed 1: draws 0, +1%, -1% (mean 0, squares 2); seed 2: 0, +2%, +4% (mean 2, squares 8).
    rows = [row(1, 0.98, 2.02), row(1, 1.02, 1.98), row(2, 0.98, 2.04), row(2, 1.02, 2.08)]
    table = nf.table(rows)
    assert "| `onecycle-ddp` | tuning | 1: +1.00, -1.00; 2: +2.00, +4.00 | 1.58 | +1.50% |" in table
    # The plain runs are the sweep's own command line at the given LR.
    run = g.Run("noise-x0.98", "sweep", 2e-3 * 0.98, None)
    cmd = g.command(g.TASKS["onecycle-ddp"], run, 1234, "", 20)
    assert cmd[cmd.index("--mode") + 1] == "plain" and cmd[cmd.index("--lr") + 1] == "0.00196"
