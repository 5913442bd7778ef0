"""The short-horizon bias at scale: HDET's controller signals on the budget NQM, N = 8..1024.

    .venv/bin/python benchmarks/budget_sim.py --out benchmarks/results

:func:`hdet_megatron.sim.simulate_budget` (noisy quadratic, fixed budget of ``--steps`` steps under
warm-up + cosine to 1/10, best peak LR known by an exact sweep) from a peak LR 4x too low and 4x
too high, for N = arms x replicas_per_arm replicas (one arm per replica, and arms of 8 replicas),
with each controller signal:

- ``train`` (the paper's; softmax rule, meta LR 0.5, momentum 0.5: the quality benchmark's
  settings) with the arms' data noise of the model;
- ``probe`` (the same rule on noise-free window-end losses): shows the short-horizon bias alone;
- ``line`` and ``average`` with the ``newton`` rule (meta LR 1, momentum 0.5).

Reported per cell: the expected final loss relative to a perfect sweep (mean over seeds) and the
LR at the end relative to the best peak LR (geometric mean).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.sim import simulate_budget

SIGNALS = {
    "train": dict(signal="train", rule="relative", meta_lr=0.5, momentum=0.5),
    "probe": dict(signal="probe", rule="relative", meta_lr=0.5, momentum=0.5),
    "line": dict(signal="line", rule="newton", meta_lr=1.0, momentum=0.5),
    "average": dict(signal="average", rule="newton", meta_lr=1.0, momentum=0.5),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    p.add_argument("--starts", type=float, nargs="+", default=[0.25, 4.0])
    p.add_argument("--signals", nargs="+", choices=sorted(SIGNALS), default=list(SIGNALS))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--period", type=int, default=20)
    p.add_argument("--spread", type=float, default=0.3)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    rows = []
    print(
        f"{'N':>5} {'arms':>5} {'per arm':>7} {'signal':>8} {'start':>6} {'gap':>8} "
        f"{'end lr/best':>11} {'s':>5}",
        flush=True,
    )
    for n in args.replicas:
        for per_arm in sorted({1, 8} if n >= 16 else {1}):
            arms = n // per_arm
            for name in args.signals:
                config = HDETConfig(
                    period=args.period, axes=(Axis("lr", args.spread),), temperature="auto", **SIGNALS[name]
                )
                for start in args.starts:
                    t0 = time.perf_counter()
                    runs = [
                        simulate_budget(config, arms, start, args.steps, replicas_per_arm=per_arm, seed=seed)
                        for seed in range(args.seeds)
                    ]
                    gap = sum(r.gap for r in runs) / len(runs)
                    end = math.exp(sum(math.log(r.effective_scales[-1]) for r in runs) / len(runs))
                    row = {
                        "replicas": n,
                        "arms": arms,
                        "replicas_per_arm": per_arm,
                        "signal": name,
                        "start": start,
                        "gap": gap,
                        "gaps": [r.gap for r in runs],
                        "end_lr_over_best": end,
                        "seconds": time.perf_counter() - t0,
                    }
                    rows.append(row)
                    print(
                        f"{n:>5} {arms:>5} {per_arm:>7} {name:>8} {start:>6g} {gap:>+8.3f} {end:>11.3f} "
                        f"{row['seconds']:>5.1f}",
                        flush=True,
                    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "budget_sim.json"), "w") as f:
        json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
