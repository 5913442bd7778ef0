"""What the auto-LR controller's line signal says per window, from finished runs (issue 35).

    .venv/bin/python benchmarks/generalize.py --tasks onecycle-ddp --fixed --only fixed-x1 fixed-x4
    .venv/bin/python benchmarks/signal_audit.py benchmarks/results/generalize/onecycle-ddp/fixed-x*-s1234

Reads the ``window`` records (``line``: points and mean probe losses; ``update``: the logged raw
step, se and confidence) of HDET runs of ``benchmarks/generalize.py`` or the example, and
recomputes the ``newton`` rule's raw step (log of the target factor, clipped to 2x either way)
from the logged line in two ways:

- ``as run``: the rule as it is (the fitted minimum of the ``average`` line);
- ``lag-corrected``: the ``average`` line is scored at the window-averaged iterate
  ``theta0 - s * mean_t D_t``; when the iterate drifts steadily, ``mean_t D_t = (T+1)/(2T) D_T``,
  so multiplier ``s`` on that line is the displacement of multiplier ``r s`` on the end line
  (``r = (T+1)/(2T)``, about 1/2) and the end line's minimum sits at ``r`` times the average
  line's. This is the correction with ``r`` *assumed*; the window engine could measure it per
  window as ``<mean_t D_t, D_T> / <D_T, D_T>``.

A third column reads what the arms' own training said (``train slope``): per window, the
least-squares slope of each arm's mean training loss over the window against the log of its LR
multiplier (``arm_train_losses`` against ``arm_values``), averaged over the windows with its
standard error over them. It is positive when the arms that trained faster did worse.

A run at a fixed LR measures the signal without feedback: from a guess ``g`` times the best sweep
LR an unbiased signal says about ``-log(g)`` on average (up from best/4, nothing at the best LR,
down from 4x). Auto-LR off skips the probes, so such runs keep the controller on and never let it
move (``generalize.py`` rows ``fixed-x{g}``: ``meta_lr`` 0, ``start_scale`` 1, no brake).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generalize import read_windows  # noqa: E402

from hdet_megatron.line_signal import fit_quadratic  # noqa: E402

MAX_STEP = math.log(2.0)


def newton_log_step(points: list[float], losses: list[float], scale_points: float = 1.0) -> float:
    """The ``newton`` rule's log target factor from a line's (points, losses), with the points
    rescaled by ``scale_points`` (the lag correction); 0 without 3 finite points."""
    pts = [(p * scale_points, v) for p, v in zip(points, losses, strict=True) if math.isfinite(v)]
    if len(pts) < 3:
        return 0.0
    center = scale_points  # the arms' centre (multiplier 1) on the rescaled axis
    _, g, q = fit_quadratic([p - center for p, _ in pts], [v for _, v in pts])
    lo, hi = min(p for p, _ in pts), max(p for p, _ in pts)
    target = center - g / q if q > 0 else (hi if g < 0 else lo if g > 0 else center)
    factor = target / 1.0 if target > 0 else 0.0  # relative to the run's own multiplier 1
    return math.log(min(max(factor, 1 / 2.0), 2.0)) if factor > 0 else -MAX_STEP


def train_slope(window: dict) -> float:
    """Slope of the arms' window training losses against log LR multiplier (nan if not logged)."""
    losses = window.get("arm_train_losses")
    multipliers = (window.get("arm_values") or {}).get("lr")
    if not losses or not multipliers or not all(math.isfinite(v) for v in losses):
        return math.nan
    xs = [math.log(m) for m in multipliers]
    mx, my = math.fsum(xs) / len(xs), math.fsum(losses) / len(losses)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, losses, strict=True)) / sxx if sxx else math.nan


def audit(run_dir: str, period: int) -> dict:
    r = (period + 1) / (2 * period)
    rows = []
    for w in read_windows(run_dir):
        line, update = w.get("line"), w.get("update") or {}
        if not line:
            continue
        losses = [float(v) for v in line["losses"]]
        rows.append(
            {
                "logged": (update.get("raw_deltas") or {}).get("lr", math.nan),
                "as_run": newton_log_step(line["points"], losses),
                "lag": newton_log_step(line["points"], losses, r),
                "confidence": (update.get("confidence") or {}).get("lr", math.nan),
                "se": (update.get("step_se") or {}).get("lr", math.nan),
                "train_slope": train_slope(w),
            }
        )
    return {"windows": rows, "r": r}


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error over the finite values (nan when fewer than 2)."""
    xs = [v for v in values if math.isfinite(v)]
    if len(xs) < 2:
        return math.nan, math.nan
    m = math.fsum(xs) / len(xs)
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="HDET run directories")
    p.add_argument("--period", type=int, default=10, help="the runs' converge period T")
    args = p.parse_args()
    print(
        "| run | windows | logged raw step: mean (up / clipped) | recomputed as run | lag-corrected "
        "| se = 0 | confidence >= 0.99 | train slope (mean +- se) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        res = audit(run, args.period)
        ws = res["windows"]
        if not ws:
            continue

        def mean(key: str, ws: list = ws) -> float:
            return math.fsum(w[key] for w in ws) / len(ws)

        slope, slope_se = mean_se([w["train_slope"] for w in ws])
        up = sum(w["logged"] > 0 for w in ws)
        clipped = sum(abs(w["logged"]) >= MAX_STEP - 1e-9 for w in ws)
        print(
            f"| {os.path.basename(os.path.normpath(run))} | {len(ws)} | "
            f"{mean('logged'):+.3f} ({up} / {clipped}) | "
            f"{mean('as_run'):+.3f} | {mean('lag'):+.3f} | {sum(w['se'] == 0 for w in ws)} | "
            f"{sum(w['confidence'] >= 0.99 for w in ws)} | {slope:+.4f} +- {slope_se:.4f} |"
        )


if __name__ == "__main__":
    main()
