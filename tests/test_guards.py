"""Auto-LR guards (issue 25): slow start, the brake, noise-aware steps and the warm-up hold.

Unit checks on the controller with hand-made windows, the NQM from both sides through
``hdet simulate``, and one 4-rank ``HDETOneCycleLR`` world whose LR is forced far too high.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.controller import NEWTON_MAX_STEP, AutoController
from hdet_megatron.line_signal import fit_line
from hdet_megatron.sim import BudgetNQM, simulate_budget
from tests.harness import run_world
from tests.probe_worker import ProbeRun, world_runs

RHO = [0.7, 0.9, 1.1, 1.3]


def average(**kw) -> AutoController:
    """The probe defaults (average + newton, 4 arms) with ``kw`` on top."""
    return AutoController(HDETConfig(period=10, signal="average", **kw), 4)


def train_ctl(**kw) -> AutoController:
    return AutoController(HDETConfig(period=10, axes=(Axis("lr", 0.3),), signal="train", **kw), 4)


def calm(step: int) -> list[float]:
    """A healthy window: the loss falls 2% per window, the arms differ by 1% per multiplier."""
    level = 3.0 * 0.98**step
    return [level * (1 + 0.01 * (r - 1.0)) for r in RHO]


# -- slow start ---------------------------------------------------------------------------------


def test_slow_start_starts_the_lr_axes_low_and_climbs_on_evidence():
    ctl = average()
    assert ctl.config.start_scale == 0.25 and ctl.scale("lr") == 0.25
    assert "slow start at 0.25x" in ctl.resolution_note
    # The losses fall towards higher multipliers: newton steps up (at most NEWTON_MAX_STEP).
    up = ctl.update([(r - 3.0) ** 2 for r in RHO], {"lr": RHO}, step=10, train_losses=calm(0))
    assert up.brake is None and ctl.scale("lr") == pytest.approx(0.25 * NEWTON_MAX_STEP**0.5)
    # Other multiplicative axes start at 1, lr:<group> axes low too; auto off: no slow start.
    ctl = AutoController(
        HDETConfig(axes=(Axis("lr:emb", 0.2), Axis("weight_decay", 0.2)), signal="train", start_scale=0.5), 4
    )
    assert ctl.scales() == {"lr:emb": 0.5, "weight_decay": 1.0}
    assert AutoController(HDETConfig(auto=False, signal="average"), 4).scale("lr") == 1.0
    # The paper's train signal cannot climb back far: it starts at the user's LR.
    assert AutoController(HDETConfig(), 4).scale("lr") == 1.0


# -- the brake ----------------------------------------------------------------------------------


def run_windows(ctl: AutoController, windows: list[list[float]], signal=None) -> list:
    ups = []
    for k, train in enumerate(windows):
        losses = signal[k] if signal is not None else train
        ups.append(ctl.update(losses, {"lr": RHO}, step=10 * (k + 1), train_losses=train))
    return ups


def answering(x: float, level: float) -> float:
    """A loss that answers the LR: best at the effective LR ``x = c * rho`` of 1, 5% worse at
    e-fold off it."""
    return level * (1 + 0.05 * math.log(x) ** 2)


def test_brake_is_silent_in_healthy_and_noisy_runs():
    """Healthy runs whose losses answer the controller's scale (best at scale 1): the brake never
    fires, the controller moves, and the scale settles near 1 (not at a bound: a test whose
    losses ignored the scale would let it climb to 100 and call that healthy)."""
    rng = np.random.default_rng(0)
    for ctl in (train_ctl(), average()):
        start = ctl.scale("lr")
        ups = []
        for k in range(60):
            c, level = ctl.scale("lr"), 3.0 * 0.98**k
            train = [answering(c * r, level) + 0.03 * rng.standard_normal() for r in RHO]
            # average: the line's points answer the scale too (noise-free here: the probe's).
            signal = train if ctl.config.signal == "train" else [answering(c * r, level) for r in RHO]
            ups.append(ctl.update(signal, {"lr": RHO}, step=10 * (k + 1), train_losses=train))
        assert [u.brake for u in ups] == [None] * 60
        assert all(u.hold == 0 for u in ups)
        assert any(u.moved and u.deltas["lr"] != 0.0 for u in ups)
        scales = [u.scales["lr"] for u in ups]
        assert 0.5 < scales[-1] < 2.0 and max(scales) < 4.0, (ctl.config.signal, start, scales)
    # The average controller climbed from its slow start to the right scale.
    assert start == 0.25 and 0.8 < scales[-1] < 1.25, scales


def test_brake_fires_on_a_spike_cuts_and_holds():
    ctl = average()
    healthy = [calm(k) for k in range(5)]
    spike = calm(5)
    spike[3] *= 1.5  # the arm with multiplier 1.3 jumps 50% off the others' trend
    up_signal = [[(r - 3.0) ** 2 for r in RHO]] * 9  # newton: "go higher"
    after = [calm(k) for k in range(6, 9)]
    ups = run_windows(ctl, healthy + [spike] + after, up_signal)
    assert [u.brake is not None for u in ups] == [False] * 5 + [True] + [False] * 3
    assert "highest-LR arm 3" in ups[5].brake
    before = ups[4].scales["lr"]
    assert ups[5].scales["lr"] == pytest.approx(before * 0.5) and ups[5].velocities["lr"] == 0.0
    # Held for brake_hold = 2 windows (no rise although the signal says "higher"), then free.
    assert [u.hold for u in ups[5:]] == [2, 1, 0, 0]
    assert ups[6].scales["lr"] == ups[5].scales["lr"] and ups[7].scales["lr"] == ups[5].scales["lr"]
    assert ups[8].scales["lr"] > ups[7].scales["lr"]


def test_a_braked_spike_does_not_desensitize_the_brake():
    """The same spike after the hold brakes again: a braked window's spike stays out of the RMS
    history and the noise level that the next windows are judged by."""
    ctl = average()
    spike = calm(5)
    spike[3] *= 1.5
    again = calm(8)
    again[3] *= 1.5
    windows = [calm(k) for k in range(5)] + [spike, calm(6), calm(7), again]
    ups = run_windows(ctl, windows, [[(r - 3.0) ** 2 for r in RHO]] * 9)
    assert [u.brake is not None for u in ups] == [False] * 5 + [True, False, False, True]
    assert ups[8].scales["lr"] == pytest.approx(ups[7].scales["lr"] * 0.5)


def test_brake_fires_on_non_finite_arms_a_blow_up_and_a_rise_of_the_high_arms():
    ctl = average()
    run_windows(ctl, [calm(k) for k in range(4)])
    bad = calm(4)
    bad[2] = math.inf
    before = ctl.scale("lr")
    up = ctl.update([0.0, 0.0, math.inf, 0.0], {"lr": RHO}, step=50, train_losses=bad)
    assert "non-finite" in up.brake and up.scales["lr"] == pytest.approx(before * 0.5)

    ctl = average()
    run_windows(ctl, [calm(k) for k in range(4)])
    up = ctl.update([0.0] * 4, {"lr": RHO}, step=50, train_losses=[x * 10 for x in calm(4)])
    assert "blew up" in up.brake

    ctl = average()
    run_windows(ctl, [calm(k) for k in range(4)])
    rise = calm(4)
    rise[2] *= 1.3  # both high arms rise 30% while the low arms keep falling
    rise[3] *= 1.3
    up = ctl.update([0.0] * 4, {"lr": RHO}, step=50, train_losses=rise)
    assert "high-LR arms' loss rose" in up.brake


def test_a_loss_that_grows_with_the_lr_is_no_spike():
    # A noise floor: every window the loss is proportional to the arm's LR (top arm 30% above
    # the centre), and the controller raising the scale raises every arm alike.
    ctl = train_ctl()
    ups = run_windows(ctl, [[0.1 * r * (1 + 0.2 * k) for r in RHO] for k in range(10)])
    assert [u.brake for u in ups] == [None] * 10


def test_brake_state_survives_a_checkpoint():
    ctl = average()
    run_windows(ctl, [calm(k) for k in range(5)])
    spike = calm(5)
    spike[3] *= 1.5
    ctl.update([0.0] * 4, {"lr": RHO}, step=60, train_losses=spike)
    state = json.loads(json.dumps(ctl.state_dict()))
    saved_scale = ctl.scale("lr")
    assert state["version"] == 2 and state["hold"] == 2
    twin = average()
    twin.load_state_dict(state)
    for k in range(6, 9):
        a = ctl.update([(r - 3.0) ** 2 for r in RHO], {"lr": RHO}, step=10 * k, train_losses=calm(k))
        b = twin.update([(r - 3.0) ** 2 for r in RHO], {"lr": RHO}, step=10 * k, train_losses=calm(k))
        assert a.to_dict() == b.to_dict()
    # A version-1 state (before the guards) loads with nothing held.
    old = dict(state, version=1)
    for key in ("hold", "last_mean_loss", "noise", "last_halves", "history"):
        old.pop(key)
    fresh = average()
    fresh.load_state_dict(old)
    assert fresh.hold == 0 and fresh.last_mean_loss is None and fresh.scale("lr") == saved_scale


# -- warm-up hold -------------------------------------------------------------------------------


def _up_line():
    """Every replica's line minimum at 1.6: the step says "higher" every window."""
    rows = [[(p - 1.6) ** 2 for p in RHO] for _ in range(4)]
    means = [math.fsum(col) / 4 for col in zip(*rows, strict=True)]
    return fit_line(RHO, means, RHO, 1.0, rows)


def _scales(ctl: AutoController, bases: list[float], first: int = 0) -> list[float]:
    line, out = _up_line(), []
    for k, base in enumerate(bases, start=first):
        ctl.update(line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), base_values={"lr": base}, line=line)
        out.append(ctl.scale("lr"))
    return out


def test_warmup_hold_no_rise_while_the_base_lr_rises():
    bases = [1e-4, 2e-4, 3e-4, 3e-4, 2e-4]  # warm-up, peak, decay
    held = _scales(average(start_scale=1.0, brake=False), bases)
    # The first converge has nothing to compare with (it rises); the next two end in the warm-up.
    assert held[0] > 1.0 and held[2] == held[1] == held[0]
    assert held[4] > held[3] > held[2]
    free = _scales(average(start_scale=1.0, brake=False, warmup_hold=False), bases)
    assert free[2] > free[1] > free[0] == held[0]
    # A flat or decaying schedule is never held: the same as without the hold, bit for bit.
    flat = [3e-4, 3e-4, 2e-4, 1e-4]
    assert _scales(average(), flat) == _scales(average(warmup_hold=False), flat)


def test_warmup_hold_survives_a_checkpoint():
    ctl = average(start_scale=1.0, brake=False)
    _scales(ctl, [1e-4])
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["last_bases"] == {"lr": 1e-4}
    twin = average(start_scale=1.0, brake=False)
    twin.load_state_dict(state)
    assert _scales(twin, [2e-4], first=1) == _scales(ctl, [2e-4], first=1) == [ctl.scale("lr")]
    assert twin.scale("lr") == _scales(average(start_scale=1.0, brake=False), [1e-4])[0]  # held
    # A state from before the hold resumes with nothing to compare (the next converge may rise).
    old = dict(state)
    old.pop("last_bases")
    fresh = average(start_scale=1.0, brake=False)
    fresh.load_state_dict(old)
    assert fresh.last_bases == {}
    with pytest.raises(ValueError, match="last_bases"):
        average().load_state_dict(dict(state, last_bases={"lr": "x"}))


# -- noise-aware steps --------------------------------------------------------------------------


def _newton_target(points, means) -> float:
    """Independent of the controller: numpy's quadratic fit, its minimum, bounded like newton."""
    c2, c1, _ = np.polyfit(np.asarray(points) - 1.0, means, 2)
    target = 1.0 - c1 / (2 * c2) if c2 > 0 else (max(points) if c1 < 0 else min(points))
    return float(min(max(target, 1 / NEWTON_MAX_STEP), NEWTON_MAX_STEP))


def test_noise_aware_step_shrinks_by_the_jackknife_confidence():
    points = RHO
    rng = np.random.default_rng(3)
    truth = [(p - 1.2) ** 2 for p in points]  # minimum at 1.2
    for noise in (0.0, 0.02, 0.5):
        rows = [[t + noise * rng.standard_normal() for t in truth] for _ in range(8)]
        means = [float(np.mean(col)) for col in zip(*rows, strict=True)]
        line = fit_line(points, means, RHO, 1.0, rows)
        ctl = AutoController(
            HDETConfig(signal="average", start_scale=1.0, brake=False, momentum=0.0), 4, probe_available=True
        )
        up = ctl.update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
        d = math.log(_newton_target(points, means))
        assert up.raw_deltas["lr"] == pytest.approx(d, rel=1e-9, abs=1e-12)
        # Delete-one jackknife over the 8 replicas, by numpy.
        loo = []
        for i in range(8):
            rest = [row for j, row in enumerate(rows) if j != i]
            loo.append(math.log(_newton_target(points, np.mean(rest, axis=0))))
        se = math.sqrt(7 / 8 * sum((x - np.mean(loo)) ** 2 for x in loo))
        assert up.step_se["lr"] == pytest.approx(se, rel=1e-6, abs=1e-12)
        conf = d * d / (d * d + se * se)
        assert up.confidence["lr"] == pytest.approx(conf, rel=1e-6)
        assert up.deltas["lr"] == pytest.approx(conf * d, rel=1e-6, abs=1e-12)
        assert ctl.scale("lr") == pytest.approx(math.exp(conf * d), rel=1e-6)
        if noise == 0.0:
            assert up.confidence["lr"] == 1.0
        if noise == 0.5:
            assert up.confidence["lr"] < 0.5  # a weak signal barely moves the scale
    # Off: the raw step.
    ctl = AutoController(HDETConfig(signal="average", start_scale=1.0, noise_aware=False), 4)
    up = ctl.update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert up.deltas == up.raw_deltas and up.confidence == {}


# -- the NQM from both sides (hdet simulate) ----------------------------------------------------


def test_simulate_shows_the_guards_from_both_sides(capsys):
    from hdet_megatron.cli import main

    common = ["simulate", "--problem", "budget", "--period", "50", "--spread", "0.3", "--signal", "average"]
    common += ["--rule", "newton", "--meta-lr", "1", "--momentum", "0.5", "--probe-noise", "0.02"]
    # From 4x too high: slow start at 1/4, noise-aware steps logged, no brake needed.
    assert main(common + ["--base-lr-factor", "4", "--every", "100"]) == 0
    high = capsys.readouterr().out
    assert "start scale 0.25, brake on, noise-aware on" in high and "confidence" in high
    assert "brake:" not in high
    # From far too high (the NQM diverges): the brake cuts the scale where the loss blows up.
    assert main(common + ["--base-lr-factor", "200", "--every", "100"]) == 0
    assert "brake: " in capsys.readouterr().out
    # From 4x too low, the guards on and off both climb.
    for extra in ([], ["--start-scale", "1", "--no-brake", "--no-noise-aware"]):
        assert main(common + ["--base-lr-factor", "0.25", "--every", "100"] + extra) == 0
        assert "vs the best sweep point" in capsys.readouterr().out
    problem = BudgetNQM(dim=16, probe_noise=0.02)
    config = HDETConfig(period=50, signal="average")
    low = simulate_budget(config, 8, 0.25, 1000, problem=problem)
    assert low.scales[-1] > low.scales[0]
    # From 4x too high the run must end near the right LR, not only without a brake: the LR
    # over the run (geometric mean of the peak LR / the best, per window) within [1/3, 2], the
    # expected loss within 25% of a perfect sweep's and far below plain training at that guess;
    # and the controller acted (the slow start alone lands on the best LR from exactly 4x).
    auto = HDETConfig(
        period=50, axes=(Axis("lr", 0.3),), signal="average", rule="newton", meta_lr=1.0, momentum=0.5
    )
    for seed in range(3):
        run = simulate_budget(auto, 8, 4.0, 1000, problem=problem, seed=seed)
        plain = simulate_budget(auto.replace(auto=False), 8, 4.0, 1000, problem=problem, seed=seed)
        mean_scale = math.exp(float(np.mean(np.log(run.effective_scales))))
        assert 1 / 3 < mean_scale < 2.0 and run.gap < 0.25 and run.gap < plain.gap / 4, (seed, mean_scale)
        assert any(u.moved and u.deltas["lr"] != 0.0 for u in run.updates)


# -- a 4-rank world forced far too high -----------------------------------------------------------


def test_brake_in_a_4_rank_ddp_world():
    """HDETOneCycleLR (DDP, train signal, 4 arms): at a peak LR 40x too high the losses blow up
    and the brake halves the scale at that window; the same run at a sane LR never brakes."""
    specs = [
        ProbeRun(signal="train", steps=24, period=3, max_lr=0.05),
        ProbeRun(signal="train", steps=24, period=3, max_lr=2.0),
    ]
    sane, wild = run_world(4, world_runs, specs)[0]
    assert [h["update"]["brake"] for h in sane["history"]] == [None] * 8
    brakes = [h["update"]["brake"] for h in wild["history"]]
    assert brakes[1] is not None and "blew up" in brakes[1], brakes
    assert wild["history"][1]["scales"]["lr"] == pytest.approx(wild["history"][0]["scales"]["lr"] * 0.5)
    assert wild["history"][1]["update"]["hold"] == 2
