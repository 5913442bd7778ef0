"""Issue 35's controller prototypes (``hdet_megatron.controller.PROTOTYPES``, off unless a
benchmark switches them on; none is open now), and the line scored wider than the arms train
(the prototype ``wide_line`` once, the config field ``line_width`` now). The prototypes rejected
in BENCHMARKS 3e-3s were removed with their tests (those of 3e-3m rerun at commit b3a601d,
``hold_first`` at commit b32f5fe, the unclipped jackknife at commit 6a105d6, the decay-scaled rise
at commit 3e7d803)."""

from __future__ import annotations

import math

import pytest

from hdet_megatron import controller
from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController
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


def test_off_by_default_and_unknown_names_refused(prototypes):
    assert controller.PROTOTYPES == set()
    prototypes.add("no_such_thing")
    line = _line([1.2] * 4)
    with pytest.raises(ValueError, match="unknown controller prototypes"):
        _controller().update(line.pseudo_losses, {"lr": RHO}, step=10, line=line)


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
