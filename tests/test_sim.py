"""The NQM simulator (hdet_megatron.sim) and what the controller does on it."""

from __future__ import annotations

import math

import numpy
import pytest

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.controller import AllArmsNonFinite
from hdet_megatron.sim import NQMProblem, best_lr, simulate, steady_state_loss, sweep_lr

# Settings for the sim: the paper's controller defaults (lambda 0.5, beta 0.9, alpha 1/9, 8
# arms) except a shorter period (the NQM's slowest mode relaxes in ~100 steps, not ~1000) and
# sigma="auto" (the NQM's loss differences between arms are ~1% of the loss, far below the
# paper's fixed sigma = 0.1, which would make the weights almost uniform and the controller
# very slow).
SIM = HDETConfig(period=100, temperature="auto")
STEPS = 20000  # 200 windows


def test_problem_has_an_interior_optimum():
    problem = NQMProblem()
    opt = best_lr(problem, 8)
    assert 0.2 < opt < 0.35
    f = lambda x: steady_state_loss(problem, x, 8)  # noqa: E731
    assert f(opt) < f(opt * 0.9) and f(opt) < f(opt * 1.1)
    # 4x off either way is clearly worse, yet 4x too high times the top multiplier is stable.
    assert f(opt / 4) > 1.5 * f(opt) and f(4 * opt) > 1.5 * f(opt)
    assert 4 * opt * (1 + 1 / 9) < 2 / problem.h_max
    assert f(2.0 / problem.h_max) == math.inf
    # More replicas, less gradient noise: a larger optimum.
    assert best_lr(problem, 64) > best_lr(problem, 8) > best_lr(problem, 1)


def test_grid_sweep_of_plain_training_agrees_with_the_analytic_optimum():
    problem = NQMProblem()
    opt = best_lr(problem, 8)
    lrs = [opt * 2 ** (k / 4) for k in range(-6, 7)]
    measured = sweep_lr(lrs, replicas=8, steps=15000, burn_in=3000, seed=0, problem=problem)
    for lr, loss in zip(lrs, measured, strict=True):
        assert loss == pytest.approx(steady_state_loss(problem, lr, 8), rel=0.05)
    assert lrs[measured.index(min(measured))] == pytest.approx(opt, rel=0.2)
    diverged = sweep_lr([2.5], steps=3000, burn_in=0)[0]  # above 2 / h_max
    assert not diverged < 1e10  # nan or huge


@pytest.mark.parametrize("factor, seed", [(0.25, 0), (4.0, 1)])
def test_controller_finds_the_optimum_from_4x_off(factor, seed):
    opt = best_lr(NQMProblem(), 8)
    result = simulate(SIM, arms=8, base_lr=factor * opt, steps=STEPS, seed=seed)
    assert len(result.scales) == STEPS // SIM.period
    if factor < 1:
        assert result.final_scale > 2.0  # the scale rose
    else:
        assert result.final_scale < 0.5  # the scale fell
    assert 1 / 1.5 < result.final_lr / opt < 1.5
    # And the run ends near the optimum's loss, far below where it started.
    assert result.final_loss < 1.3 * steady_state_loss(NQMProblem(), opt, 8)


def test_relative_and_paper_rules_agree_on_a_constant_base():
    opt = best_lr(NQMProblem(), 8)
    rel = simulate(SIM, 8, 4 * opt, 10000, seed=2)
    paper = simulate(SIM.replace(rule="paper"), 8, 4 * opt, 10000, seed=2)
    assert paper.scales[0] == pytest.approx(rel.scales[0], rel=1e-12)  # identical at c = 1
    assert paper.final_scale == pytest.approx(rel.final_scale, rel=0.2)


def test_arm_sync_targets_the_optimum_of_one_arm():
    """Characterisation (beyond the paper): with grad_sync="arm" each arm's window loss carries
    its own (R-replica) gradient noise, so the controller settles near the optimum LR of one
    arm's batch, not of the whole data-parallel batch. (On a quadratic the converged model of
    plain "arm" training follows the same recursion as "global", so best_lr(8) is still the
    best LR for the averaged model: the arm-mode controller is biased low here)."""
    problem = NQMProblem()
    result = simulate(SIM.replace(grad_sync="arm"), 8, best_lr(problem, 8), STEPS, seed=0)
    assert 1 / 1.5 < result.final_lr / best_lr(problem, 1) < 1.5
    assert result.final_lr < 0.6 * best_lr(problem, 8)


def test_neutral_runs_are_reproducible_and_plain_training_is_the_baseline():
    opt = best_lr(NQMProblem(), 8)
    a = simulate(SIM, 8, opt, 3000, seed=5)
    b = simulate(SIM, 8, opt, 3000, seed=5)
    assert a.scales == b.scales and a.losses == b.losses
    assert simulate(SIM, 8, opt, 3000, seed=6).losses != a.losses
    plain = simulate(SIM.replace(auto=False), 8, opt, 3000, seed=5)
    assert plain.scales == [1.0] * 30
    # Global RNGs are untouched.
    numpy.random.seed(0)
    state = numpy.random.get_state()[1].copy()
    simulate(SIM, 8, opt, 1000, seed=5)
    assert (numpy.random.get_state()[1] == state).all()


def test_many_arms_and_replicas():
    problem = NQMProblem(dim=8)
    result = simulate(SIM, arms=1024, base_lr=best_lr(problem, 1024) / 4, steps=2000, dim=8, problem=problem)
    assert len(result.scales) == 20 and result.scales[-1] > 1.0
    result = simulate(SIM.replace(grad_sync="arm"), arms=4, replicas_per_arm=16, base_lr=0.1, steps=1000)
    assert all(math.isfinite(x) for x in result.losses)


def test_divergence_raises_or_rolls_back():
    unstable = 3.0  # > 2 / h_max: every arm diverges
    with pytest.raises(AllArmsNonFinite):
        simulate(SIM.replace(period=500), 8, unstable, 5000, seed=0)
    result = simulate(SIM.replace(period=500, rollback=True), 8, unstable, 5000, seed=0)
    assert result.rollbacks >= 1
    assert result.final_lr < 2.0 and math.isfinite(result.final_loss)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'lr'"):
        simulate(HDETConfig(axes=(Axis("lr", 0.1), Axis("dropout", 0.05))), 8, 0.1, 1000)
    with pytest.raises(ValueError, match="arms"):
        simulate(SIM, 0, 0.1, 1000)
    with pytest.raises(ValueError, match="base_lr"):
        simulate(SIM, 8, -0.1, 1000)
    with pytest.raises(ValueError, match="shorter than one window"):
        simulate(SIM, 8, 0.1, 50)
    with pytest.raises(ValueError, match="h_min"):
        NQMProblem(h_min=2.0)
    with pytest.raises(ValueError, match="disagrees"):
        simulate(SIM, 8, 0.1, 1000, dim=4, problem=NQMProblem(dim=8))


def test_cli_simulate_prints_the_table(capsys):
    from hdet_megatron.cli import main

    rc = main(
        [
            "simulate",
            "--arms",
            "8",
            "--period",
            "100",
            "--steps",
            "3000",
            "--seed",
            "1",
            "--base-lr-factor",
            "0.25",
            "--every",
            "10",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["window", "step", "scale"])
    rows = [line.split() for line in lines[header + 1 :] if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [0, 10, 20, 29]
    assert [int(r[1]) for r in rows] == [100, 1100, 2100, 3000]
    scales = [float(r[2]) for r in rows]
    assert scales[-1] > scales[0]  # rising from 4x too low
    assert "optimum lr=" in out and "final lr=" in out


def test_cli_options_and_errors(capsys):
    from hdet_megatron.cli import main

    assert (
        main(
            [
                "simulate",
                "--steps",
                "500",
                "--sigma",
                "0.05",
                "--rule",
                "paper",
                "--grad-sync",
                "arm",
                "--kind",
                "log",
                "--spread",
                "0.5",
                "--base-lr",
                "0.1",
            ]
        )
        == 0
    )
    assert "sigma=0.05" in capsys.readouterr().out
    assert main(["simulate", "--spread", "1.5"]) == 2
    assert "spread" in capsys.readouterr().err
    assert main(["simulate", "--steps", "50"]) == 2  # shorter than one window
    # 11.6x the optimum: without the brake every arm diverges in the first window; with it (the
    # default) the scale is cut where the losses blow up and the run ends near the optimum.
    assert main(["simulate", "--base-lr", "3.0", "--steps", "1000", "--no-brake"]) == 1
    assert "non-finite" in capsys.readouterr().err
    assert main(["simulate", "--base-lr", "3.0", "--steps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "brake: " in out and "final lr=0.3647 (1.405x optimum)" in out
    with pytest.raises(SystemExit):
        main(["simulate", "--sigma", "hot"])
    assert main(["report", "runs/does-not-exist"]) == 2  # implemented in hdet_megatron/report.py
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
