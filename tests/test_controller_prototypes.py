"""Issue 35's controller prototypes (``hdet_megatron.controller.PROTOTYPES``, off unless a
benchmark switches them on): ``average_lag`` (the ``average`` line's minimum moved to the end
line's), ``jackknife_unclipped`` (a confidence that cannot reach 1 only because every
replica's fit was clipped), ``hold_warmup``, ``no_momentum``, and ``slope_gate``/``slope_guard``
(the arms' training-loss slope on log LR vetoes rises / steps the LR down), ``half_lag``,
``warmup_cap`` and ``warmup_peak`` (a warm-up rise bounded by the schedule's peak), ``expand_clip``
(a trust region for the LR step), ``rise_carry_free`` (momentum for descents only) and
``hold_first`` (the warm-up hold at the first converge)."""

from __future__ import annotations

import math

import pytest

from hdet_megatron import controller
from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import NEWTON_MAX_STEP, AutoController, average_lag
from hdet_megatron.line_signal import fit_line

RHO = [0.7, 0.9, 1.1, 1.3]


@pytest.fixture
def prototypes(monkeypatch):
    """The module's switch, restored after the test."""
    switch: set[str] = set()
    monkeypatch.setattr(controller, "PROTOTYPES", switch)
    return switch


def _controller(signal: str = "average") -> AutoController:
    cfg = HDETConfig(period=10, signal=signal, start_scale=1.0, brake=False, momentum=0.0)
    return AutoController(cfg, 4, probe_available=True)


def _line(minima: list[float]):
    """One replica row per minimum: f(s) = (s - m)^2 at the arms' multipliers."""
    rows = [[(p - m) ** 2 for p in RHO] for m in minima]
    means = [math.fsum(col) / len(rows) for col in zip(*rows, strict=True)]
    return fit_line(RHO, means, RHO, 1.0, rows)


def test_average_lag_is_the_mean_displacement_under_steady_drift():
    assert average_lag(1) == 1.0
    assert average_lag(10) == pytest.approx(0.55)
    # mean_{t=1..T} t/T, the averaged iterate's displacement as a fraction of the end's.
    assert average_lag(20) == pytest.approx(sum(t / 20 for t in range(1, 21)) / 20)


def test_off_by_default_and_unknown_names_refused(prototypes):
    assert controller.PROTOTYPES == set()
    prototypes.add("no_such_thing")
    line = _line([1.2] * 4)
    with pytest.raises(ValueError, match="unknown controller prototypes"):
        _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)


def test_average_lag_targets_r_times_the_average_lines_minimum(prototypes):
    line = _line([1.6] * 4)  # the averaged line's minimum at 1.6
    plain = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    prototypes.add("average_lag")
    lagged = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert plain.raw_deltas["lr"] == pytest.approx(math.log(1.6))
    assert lagged.raw_deltas["lr"] == pytest.approx(math.log(1.6 * 0.55))  # 0.88: down, not up
    # Only the average signal is lagged (the line signal scores the end iterate itself).
    up = _controller("line").update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert up.raw_deltas["lr"] == pytest.approx(math.log(1.6))


def test_clipped_fits_no_longer_give_full_confidence(prototypes):
    # Every replica's minimum lies past the 2x bound, at different places.
    line = _line([2.5, 3.0, 4.0, 6.0])
    clipped = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert clipped.raw_deltas["lr"] == pytest.approx(math.log(NEWTON_MAX_STEP))
    assert clipped.step_se["lr"] == 0.0 and clipped.confidence["lr"] == 1.0  # the collapse
    prototypes.add("jackknife_unclipped")
    wide = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert wide.raw_deltas["lr"] == pytest.approx(math.log(NEWTON_MAX_STEP))  # the step is still bounded
    assert wide.step_se["lr"] > 0.0 and wide.confidence["lr"] < 1.0
    assert wide.deltas["lr"] == pytest.approx(wide.confidence["lr"] * math.log(NEWTON_MAX_STEP))
    # Replicas that agree keep a high confidence.
    agree = _line([3.0] * 4)
    up = _controller().update(agree.pseudo_losses, {"lr": RHO}, step=10, line=agree)
    assert up.confidence["lr"] == 1.0


def test_measured_lag_uses_the_lines_own_ratio(prototypes):
    from dataclasses import replace

    line = replace(_line([1.6] * 4), lag=0.35)  # measured in a warm-up: below steady drift's
    prototypes.add("measured_lag")
    up = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert up.raw_deltas["lr"] == pytest.approx(math.log(1.6 * 0.35))
    # No measurement: the steady-drift ratio, as average_lag.
    unmeasured = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=replace(line, lag=None))
    assert unmeasured.raw_deltas["lr"] == pytest.approx(math.log(1.6 * 0.55))


def test_hold_warmup_keeps_the_scale_from_rising_while_the_base_lr_rises(prototypes):
    line = _line([1.6] * 4)  # "higher" every window
    prototypes.add("hold_warmup")
    # The prototype holds whatever the config says (it predates HDETConfig.warmup_hold).
    cfg = HDETConfig(
        period=10, signal="average", start_scale=1.0, brake=False, momentum=0.0, warmup_hold=False
    )
    ctl = AutoController(cfg, 4, probe_available=True)
    scales = []
    for k, base in enumerate([1e-4, 2e-4, 3e-4, 3e-4, 2e-4]):  # warm-up, peak, decay
        ctl.update(line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), base_values={"lr": base}, line=line)
        scales.append(ctl.scale("lr"))
    # The first update has no previous base (it moves); the next one rises with the base: held.
    assert scales[0] > 1.0 and scales[1] == scales[0]
    assert scales[2] == scales[1] and scales[3] > scales[2] and scales[4] > scales[3]


def test_no_momentum_steps_by_the_windows_own_evidence(prototypes):
    up, down = _line([1.6] * 4), _line([0.8] * 4)
    ctl = AutoController(HDETConfig(period=10, signal="average", start_scale=1.0, brake=False), 4)
    prototypes.add("no_momentum")
    ctl.update(up.pseudo_losses, {"lr": RHO}, step=10, line=up)
    after_up = ctl.scale("lr")
    ctl.update(down.pseudo_losses, {"lr": RHO}, step=20, line=down)
    # Without momentum the second step is the second window's own: down by its full target.
    assert after_up == pytest.approx(1.6) and ctl.scale("lr") == pytest.approx(1.6 * 0.8)


def _train(slope: float, noise: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)) -> list[float]:
    """Arm training losses that rise by ``slope`` per unit of log multiplier (plus ``noise``)."""
    return [2.0 + slope * math.log(r) + e for r, e in zip(RHO, noise, strict=True)]


def test_slope_gate_vetoes_rises_while_the_high_arms_lose(prototypes):
    line = _line([1.6] * 4)  # the line says "higher" every window

    def run(ctl: AutoController, windows: range, slope: float) -> float:
        for k in windows:
            ctl.update(
                line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), line=line, train_losses=_train(slope)
            )
        return ctl.scale("lr")

    free = run(_controller(), range(5), 0.1)
    prototypes.add("slope_gate")
    ctl = _controller()
    assert run(ctl, range(2), 0.1) == pytest.approx(1.6**2)  # too few windows yet: the line's steps
    assert run(ctl, range(2, 5), 0.1) == pytest.approx(1.6**2)  # then held
    assert free == pytest.approx(1.6**5)
    # Falling losses with the LR: rises are free again.
    assert run(ctl, range(5, 12), -0.3) > 1.6**2


def test_slope_guard_steps_down_on_a_lasting_positive_slope_but_not_on_noise(prototypes):
    line = _line([1.0] * 4)  # the line says "stay": only the guard moves
    prototypes.add("slope_guard")
    ctl = _controller()
    for k in range(4):
        ctl.update(line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), line=line, train_losses=_train(0.1))
    # Windows 3 and 4 (SLOPE_MIN_WINDOWS = 3) step down by the guard's least step.
    assert ctl.scale("lr") == pytest.approx(math.exp(-2 * controller.SLOPE_GUARD_STEP))
    # A slope whose sign flips from window to window is noise: no step.
    noisy = _controller()
    for k in range(8):
        slope = 0.3 if k % 2 else -0.3
        noisy.update(
            line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), line=line, train_losses=_train(slope)
        )
    assert noisy.scale("lr") == pytest.approx(1.0)


def test_half_lag_targets_halfway_in_log_between_the_average_and_the_end_lines_minimum(prototypes):
    line = _line([1.6] * 4)
    prototypes.add("half_lag")
    half = _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)
    assert half.raw_deltas["lr"] == pytest.approx(math.log(1.6) + 0.5 * math.log(average_lag(10)))


def test_warmup_cap_lets_a_warm_up_rise_reach_the_users_lr_but_not_pass_it(prototypes):
    line = _line([1.6] * 4)  # "higher" every window
    prototypes.add("warmup_cap")
    cfg = HDETConfig(period=10, signal="average", start_scale=0.25, brake=False, momentum=0.0)
    ctl = AutoController(cfg, 4, probe_available=True)
    scales = []
    for k, base in enumerate([1e-4, 2e-4, 3e-4, 4e-4, 4e-4, 3e-4]):  # warm-up, peak, decay
        ctl.update(line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), base_values={"lr": base}, line=line)
        scales.append(ctl.scale("lr"))
    assert scales[:3] == pytest.approx([0.4, 0.64, 1.0])  # up to 1 in the warm-up, not 1.024
    assert scales[3] == 1.0  # still warming: capped at 1
    assert scales[4] == pytest.approx(1.6) and scales[5] == pytest.approx(1.6**2)  # after it: free


def test_warmup_peak_lets_a_warm_up_rise_put_the_peak_at_the_lines_lr_now(prototypes):
    prototypes.add("warmup_peak")
    cfg = HDETConfig(period=10, signal="average", start_scale=0.25, brake=False, momentum=0.0)
    bases = [1e-4, 2e-4, 3e-4, 4e-4, 4e-4, 3e-4]  # warm-up, peak, decay

    def run(minimum: float, peaks: bool = True) -> list[float]:
        line = _line([minimum] * 4)  # the replicas agree: confidence 1
        ctl = AutoController(cfg, 4, probe_available=True)
        scales = []
        for k, base in enumerate(bases):
            ctl.update(
                line.pseudo_losses,
                {"lr": RHO},
                step=10 * (k + 1),
                base_values={"lr": base},
                line=line,
                peak_values={"lr": max(bases[k:])} if peaks else None,
            )
            scales.append(ctl.scale("lr"))
        return scales

    # The line wants 1.6x the window's LR. Windows 2 and 3 train at 1.5e-4 and 2.5e-4 (bases
    # averaged): 1.6x that is below the 4e-4 peak, so no rise; window 4 (3.5e-4): 1.6 * 3.5 / 4 =
    # 1.4, so the scale may rise 1.4x of its 1.6x. The first update (no previous base) and the
    # ones after the warm-up are free.
    low = run(1.6)
    assert low == pytest.approx([0.4, 0.4, 0.4, 0.56, 0.896, 0.896 * 1.6])
    # A line content with about the LR it has never lifts the peak above it in the warm-up.
    near = run(1.05)
    assert near[1:4] == [near[0]] * 3
    # Without the runtime's peak the prototype falls back to the warm-up hold.
    held = run(1.6, peaks=False)
    assert held[1:4] == [held[0]] * 3 and held[4] == pytest.approx(held[0] * 1.6)


def test_no_warmup_hold_switches_the_default_hold_off(prototypes):
    line = _line([1.6] * 4)  # "higher" every window
    cfg = HDETConfig(period=10, signal="average", start_scale=1.0, brake=False, momentum=0.0)
    assert cfg.warmup_hold

    def final_scale() -> float:
        ctl = AutoController(cfg, 4, probe_available=True)
        for k, base in enumerate([1e-4, 2e-4, 3e-4]):  # a warm-up
            ctl.update(
                line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), base_values={"lr": base}, line=line
            )
        return ctl.scale("lr")

    assert final_scale() == pytest.approx(1.6)  # held after the first update
    prototypes.add("no_warmup_hold")
    assert final_scale() == pytest.approx(1.6**3)


def test_a_line_width_scores_the_line_wider_than_the_arms_train():
    from hdet_megatron.line_signal import line_points

    narrow = [0.95, 0.95 + 0.1 / 3, 1.05 - 0.1 / 3, 1.05]  # a training spread of 0.05
    assert line_points(narrow) == sorted(narrow)  # the arms' own points by default
    wide = line_points(narrow, 0.3)
    assert wide == pytest.approx(RHO, abs=1e-15)  # the default spread's points, 4 arms
    assert line_points([1.0, 1.0], 0.3) == [1.0]  # one distinct multiplier: nothing to spread
    # The same line (minimum at 1.2) gives the same step whether the arms sit on its points or
    # train narrowly inside them: the quadratic through the pseudo-losses is the line's own.
    rows = [[(p - 1.2) ** 2 for p in RHO]] * 4
    on_points = fit_line(RHO, rows[0], RHO, 1.0, rows)
    inside = fit_line(wide, rows[0], narrow, 1.0, rows)
    step_on = _controller().update(on_points.pseudo_losses, {"lr": RHO}, step=10, line=on_points)
    step_in = _controller().update(inside.pseudo_losses, {"lr": narrow}, step=10, line=inside)
    assert step_in.raw_deltas["lr"] == pytest.approx(step_on.raw_deltas["lr"]) == pytest.approx(math.log(1.2))
    # A non-finite point far out (the line blows up at 1.3x): fitted without it, every arm kept.
    losses = [(p - 1.2) ** 2 for p in RHO[:3]] + [math.inf]
    fit = fit_line(wide, losses, narrow, 1.0)
    assert all(math.isfinite(x) for x in fit.pseudo_losses) and fit.curvature == pytest.approx(2.0)


def test_expand_clip_doubles_the_bound_after_each_step_taken_at_it(prototypes):
    far, near, down = _line([50.0] * 4), _line([1.5] * 4), _line([0.01] * 4)
    prototypes.add("expand_clip")

    def steps(lines, bases=None) -> list[float]:
        ctl = _controller()
        out = []
        for k, line in enumerate(lines):
            base = None if bases is None else {"lr": bases[k]}
            update = ctl.update(
                line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), base_values=base, line=line
            )
            out.append(update.raw_deltas["lr"])
        return out

    log2 = math.log(NEWTON_MAX_STEP)
    # Far above: 2x, 4x, 8x, then capped at EXPAND_MAX_STEP.
    assert steps([far] * 4) == pytest.approx([log2, 2 * log2, 3 * log2, math.log(controller.EXPAND_MAX_STEP)])
    # A step inside the bound resets it; so does one taken at the bound the other way.
    assert steps([far, far, near, far]) == pytest.approx([log2, 2 * log2, math.log(1.5), log2])
    # A reversal gets the rule's own bound, whatever the bound grew to the other way.
    assert steps([far, far, down, down, down]) == pytest.approx([log2, 2 * log2, -log2, -log2, -2 * log2])
    # A held rise (the warm-up hold: the base LR rose) is not a step taken: the bound goes back
    # to 2x. (The first update has no previous base, so it moves and grows the bound.)
    warm = steps([far] * 4, bases=[1e-4, 2e-4, 3e-4, 3e-4])
    assert warm == pytest.approx([log2, 2 * log2, log2, log2])
    # Off: every window at the 2x bound.
    prototypes.clear()
    assert steps([far] * 3) == pytest.approx([log2] * 3)


def test_rise_carry_free_keeps_momentum_for_descents_only(prototypes):
    up, down = _line([1.6] * 4), _line([0.8] * 4)
    cfg = HDETConfig(period=10, signal="average", start_scale=1.0, brake=False, momentum=0.5)

    def scales(lines) -> list[float]:
        ctl = AutoController(cfg, 4, probe_available=True)
        out = []
        for k, line in enumerate(lines):
            ctl.update(line.pseudo_losses, {"lr": RHO}, step=10 * (k + 1), line=line)
            out.append(ctl.scale("lr"))
        return out

    lu, ld = math.log(1.6), math.log(0.8)
    assert scales([up, down]) == pytest.approx([math.exp(lu / 2), math.exp(lu / 2 + (lu / 2 + ld) / 2)])
    prototypes.add("rise_carry_free")
    # A rise moves by its own step; the descent after it starts from no velocity, not the rise's.
    assert scales([up, down]) == pytest.approx([1.6, 1.6 * math.exp(ld / 2)])
    # Descents keep the momentum: the second of two carries half the first's velocity.
    assert scales([down, down]) == pytest.approx([math.exp(ld / 2), math.exp(ld / 2 + ld / 4 + ld / 2)])


def test_hold_first_holds_a_first_window_that_ends_inside_a_warm_up(prototypes):
    line = _line([1.6] * 4)  # "higher" every window
    cfg = HDETConfig(period=10, signal="average", start_scale=1.0, brake=False, momentum=0.0)

    def scales(bases: list[float], start: float) -> list[float]:
        ctl = AutoController(cfg, 4, probe_available=True)
        out = []
        for k, base in enumerate(bases):
            ctl.update(
                line.pseudo_losses,
                {"lr": RHO},
                step=10 * (k + 1),
                base_values={"lr": base},
                line=line,
                start_values={"lr": start},
            )
            out.append(ctl.scale("lr"))
        return out

    warm_up = [1e-4, 2e-4, 2e-4]  # rising from 0, then flat
    assert scales(warm_up, start=0.0) == pytest.approx([1.6, 1.6, 1.6**2])  # the defaults
    prototypes.add("hold_first")
    assert scales(warm_up, start=0.0) == pytest.approx([1.0, 1.0, 1.6])
    # No warm-up (the schedule starts at its first window's value): the first window rises.
    assert scales([2e-4, 2e-4], start=2e-4) == pytest.approx([1.6, 1.6**2])
    # Without start values (a runtime that gave none) the defaults' evidence is all there is.
    ctl = AutoController(cfg, 4, probe_available=True)
    ctl.update(line.pseudo_losses, {"lr": RHO}, step=10, base_values={"lr": 1e-4}, line=line)
    assert ctl.scale("lr") == pytest.approx(1.6)
