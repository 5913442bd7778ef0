"""What the auto-LR controller's line signal says per window, from finished runs (issue 35).

    .venv/bin/python benchmarks/signal_audit.py benchmarks/results/generalize/onecycle-ddp/off-x*-s1234

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

A run at a fixed scale (auto off: ``off-x{g}``) measures the signal without feedback: from a guess
``g`` times the best sweep LR an unbiased signal says about ``-log(g)`` on average (up from
best/4, nothing at the best LR, down from 4x).
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
            }
        )
    return {"windows": rows, "r": r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="HDET run directories")
    p.add_argument("--period", type=int, default=10, help="the runs' converge period T")
    args = p.parse_args()
    print(
        "| run | windows | logged raw step: mean (up / clipped) | recomputed as run | lag-corrected "
        "| se = 0 | confidence >= 0.99 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        res = audit(run, args.period)
        ws = res["windows"]
        if not ws:
            continue

        def mean(key: str, ws: list = ws) -> float:
            return math.fsum(w[key] for w in ws) / len(ws)

        up = sum(w["logged"] > 0 for w in ws)
        clipped = sum(abs(w["logged"]) >= MAX_STEP - 1e-9 for w in ws)
        print(
            f"| {os.path.basename(os.path.normpath(run))} | {len(ws)} | "
            f"{mean('logged'):+.3f} ({up} / {clipped}) | "
            f"{mean('as_run'):+.3f} | {mean('lag'):+.3f} | {sum(w['se'] == 0 for w in ws)} | "
            f"{sum(w['confidence'] >= 0.99 for w in ws)} |"
        )


if __name__ == "__main__":
    main()
