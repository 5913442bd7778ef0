"""The ``line`` controller signal: a noise-free line search along the window's update, with the
short-horizon bias taken out. Pure module (floats and ``math``).

Why a line. With ``grad_sync="global"`` every arm applies the same all-reduced gradient with the
same optimizer moments and differs only by its LR multiplier ``rho_r``; so after a window that
started from the converged parameters ``theta0`` the arms lie on one line (exactly for SGD and
Adam, to first order in ``lr * weight_decay`` for AdamW)::

    theta_r = theta0 - rho_r * D            D = the window's update at multiplier 1

Every replica can therefore rebuild any point ``theta(s) = theta0 - s * D`` of that line from
its own parameters (``theta0 + (s / rho_r) * (theta_r - theta0)``) and evaluate it on *its own*
unseen batch. Averaged over the replicas, the losses ``f(s_k)`` at the arms' multipliers compare
the multipliers on the same data, so the data noise that dominates the ``train`` signal cancels
(BENCHMARKS.md section 3: 85-97% of the train signal was which shard an arm saw).

Why a correction. ``f`` alone is short-horizon biased towards small steps. Fit
``f(s) ~ a + g x + q x^2 / 2`` with ``x = s - 1``. In a direction where the iterate has reached
its noise floor (it fluctuates around the optimum with a variance proportional to the LR),
``theta0`` and ``theta(1)`` are two independent samples, and the line between them is lowest at
``s = 1/2``: the direction adds ``+q_n / 2`` to the slope ``g`` at ``s = 1`` and ``q_n`` to the
curvature (averaging two noisy iterates beats either one). That preference is real for the loss
at the window's end, but later windows forget it: a noise floor re-equilibrates to the LR used
*then*, and at the end of the run to the final LR. What persists is the progress in slow
directions, whose contribution to ``q`` is negligible (their steps are small). So the slope the
long horizon cares about is::

    g_long = g - (1 - kappa) * q / 2

where ``kappa`` is the part of today's noise floor that survives to the end of the run; with a
noise floor proportional to the LR that is ``kappa = base_lr(end) / base_lr(now)`` (0.1 early in
a cosine decay to LR/10, 1 in its last window or with a constant LR). The arms' *pseudo-losses*
``a + g_long x_r + q x_r^2 / 2`` are what the controller compares. ``hdet_megatron.sim`` checks
this on a noisy quadratic with an LR schedule, where the uncorrected comparison (``probe`` and
``train``) drives the LR to a fraction of the best one and the corrected one does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LineFit", "line_points", "fit_line", "fit_quadratic", "persistence", "jackknife_fits"]


@dataclass(frozen=True)
class LineFit:
    """One window's line search (plain data, for logs)."""

    points: list[float]
    """Multipliers ``s_k`` at which the line was evaluated (the arms' distinct multipliers)."""
    losses: list[float]
    """Mean loss over all replicas' probe batches at each point."""
    slope: float
    """``g``: fitted ``df/ds`` at ``s = 1``."""
    curvature: float
    """``q``: fitted ``d2f/ds2``."""
    persistence: float
    """``kappa``: the fraction of the present noise floor that survives to the run's end."""
    corrected_slope: float
    """``g - (1 - kappa) * max(q, 0) / 2``."""
    pseudo_losses: list[float]
    """Per arm: the corrected quadratic at the arm's multiplier (what the controller compares);
    ``inf`` for an arm whose own point's loss was not finite."""
    replicas: list[list[float]] = field(default_factory=list)
    """Each replica's own loss at every point (rows of healthy replicas; :attr:`losses` is their
    mean): their spread is the fit's noise (:func:`jackknife_fits`)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["replicas"]  # per-replica rows stay out of the logs (one row per DP replica)
        out["pseudo_losses"] = [x if math.isfinite(x) else repr(x) for x in self.pseudo_losses]
        out["losses"] = [x if math.isfinite(x) else repr(x) for x in self.losses]
        return out


def line_points(multipliers: Sequence[float], width: float | None = None) -> list[float]:
    """The distinct multipliers of a window, ascending: where every replica evaluates the line.
    ``width``: as many points instead, evenly spaced over ``[1 - width, 1 + width]`` (the line
    is known beyond the arms, so it can be scored wider than they train)."""
    distinct = sorted(set(float(m) for m in multipliers))
    if width is None or len(distinct) < 2:
        return distinct
    n = len(distinct)
    return [1.0 + width * (2.0 * k / (n - 1) - 1.0) for k in range(n)]


def persistence(base_now: float, base_end: float) -> float:
    """``kappa = base_end / base_now`` clamped to ``[0, 1]`` (1 when the LR is 0 now)."""
    if not base_now > 0 or not math.isfinite(base_now) or not math.isfinite(base_end):
        return 1.0
    return min(max(base_end / base_now, 0.0), 1.0)


def fit_quadratic(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + g x + (q/2) x^2``; returns ``(a, g, q)``. Needs >= 3 distinct x.

    Normal equations solved by Cramer's rule on x centred at its mean (well conditioned for the
    narrow ranges of arm multipliers), then shifted back to the origin of ``xs``.
    """
    if len(set(xs)) < 3 or len(xs) != len(ys):
        raise ValueError(f"a quadratic needs >= 3 distinct points, got {sorted(set(xs))}")
    n = len(xs)
    mean = math.fsum(xs) / n
    u = [x - mean for x in xs]
    s1 = math.fsum(u)
    s2 = math.fsum(v * v for v in u)
    s3 = math.fsum(v**3 for v in u)
    s4 = math.fsum(v**4 for v in u)
    t0 = math.fsum(ys)
    t1 = math.fsum(v * y for v, y in zip(u, ys, strict=True))
    t2 = math.fsum(v * v * y for v, y in zip(u, ys, strict=True))
    m = [[n, s1, s2], [s1, s2, s3], [s2, s3, s4]]
    rhs = [t0, t1, t2]

    def det(a: list[list[float]]) -> float:
        return (
            a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
        )

    d = det(m)
    if d == 0 or not math.isfinite(d):
        raise ValueError(f"a quadratic needs >= 3 distinct points, got {sorted(set(xs))}")
    coef = []
    for col in range(3):
        mc = [row[:] for row in m]
        for r in range(3):
            mc[r][col] = rhs[r]
        coef.append(det(mc) / d)
    c0, c1, c2 = coef  # y = c0 + c1 u + c2 u^2 with u = x - mean
    # Back to x: a = y(0), g = y'(0), q = y''.
    a = c0 - c1 * mean + c2 * mean * mean
    g = c1 - 2.0 * c2 * mean
    return a, g, 2.0 * c2


def fit_line(
    points: Sequence[float],
    losses: Sequence[float],
    arm_multipliers: Sequence[float],
    kappa: float,
    replica_losses: Sequence[Sequence[float]] = (),
) -> LineFit:
    """The window's :class:`LineFit`: fit the finite ``(points, losses)``, correct the slope,
    evaluate the pseudo-loss of every arm.

    With fewer than 3 finite points there is nothing to fit: every arm whose point is finite
    gets the same pseudo-loss (no information, so the controller does not move).
    ``replica_losses``: the replicas' own rows behind ``losses`` (kept for :func:`jackknife_fits`).
    """
    rows = [[float(v) for v in row] for row in replica_losses]
    points = [float(p) for p in points]
    losses = [float(v) for v in losses]
    if len(points) != len(losses):
        raise ValueError(f"{len(points)} line points but {len(losses)} losses")
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa={kappa!r} must be in [0, 1]")
    finite = [(p, v) for p, v in zip(points, losses, strict=True) if math.isfinite(v)]
    own = {p: v for p, v in zip(points, losses, strict=True)}
    # An arm off the points (a line scored wider than the arms train) has no point of its own:
    # a non-finite point far out says the line blows up there, not that the arm did (the window
    # engine excludes an arm whose own parameters are not finite).
    bad = [not math.isfinite(own.get(float(m), 0.0)) for m in arm_multipliers]
    if len(finite) < 3:
        level = min((v for _, v in finite), default=0.0)
        pseudo = [math.inf if b else level for b in bad]
        return LineFit(points, losses, 0.0, 0.0, kappa, 0.0, pseudo, rows)
    a, g0, q = fit_quadratic([p - 1.0 for p, _ in finite], [v for _, v in finite])
    # g0 is the slope at x = 0, i.e. s = 1.
    corrected = g0 - (1.0 - kappa) * max(q, 0.0) / 2.0
    pseudo = []
    for m, b in zip(arm_multipliers, bad, strict=True):
        x = float(m) - 1.0
        pseudo.append(math.inf if b else a + corrected * x + 0.5 * q * x * x)
    return LineFit(points, losses, g0, q, kappa, corrected, pseudo, rows)


#: The most leave-a-group-out fits per window (groups of consecutive replicas).
JACKKNIFE_GROUPS = 8


def jackknife_fits(line: LineFit, arm_multipliers: Sequence[float]) -> list[LineFit]:
    """The fit again with each replica (group) left out in turn (empty with < 3 replicas): the
    spread of what they imply is the standard error of the window's step (every replica
    evaluated the same line on its own batch, so the replicas are independent samples)."""
    n = len(line.replicas)
    if n < 3:
        return []
    # Delete-a-group jackknife: at most JACKKNIFE_GROUPS fits whatever the replica count.
    groups = min(n, JACKKNIFE_GROUPS)
    fits = []
    for leave in range(groups):
        rows = [row for i, row in enumerate(line.replicas) if i * groups // n != leave]
        means = [math.fsum(col) / len(rows) for col in zip(*rows, strict=True)]
        fits.append(fit_line(line.points, means, arm_multipliers, line.persistence))
    return fits
