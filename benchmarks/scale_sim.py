"""Scale by simulation: the controller's error and the converge cost from 8 to 1024 replicas.

    .venv/bin/python benchmarks/scale_sim.py --out benchmarks/results

Runs :func:`hdet_megatron.sim.simulate` (noisy quadratic model, known optimum LR) from a base LR
4x too low for N = arms x replicas_per_arm in 8..1024 (one arm per replica, and hierarchical
arms of 8 replicas each), converge periods T and both gradient sync modes (``global``: the
paper's DDP, every arm steps along the all-replica mean gradient; ``arm``: gradients averaged
inside an arm only). Reports the final LR relative to the optimum
(``|log2(lr/opt)|`` is the controller's error in octaves) and the converge cost of a real model
under the ring all-reduce cost model: each converge moves ``2 (N_arms-1)/N_arms * bytes`` per
rank, amortised over T steps, next to the gradient all-reduce a DDP step already pays
(``2 (N-1)/N * bytes`` per step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.sim import best_lr, simulate


def ring_bytes(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    p.add_argument("--periods", type=int, nargs="+", default=[25, 100, 400])
    p.add_argument("--windows", type=int, default=60, help="converge windows per run")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument(
        "--grad-sync",
        nargs="+",
        choices=("global", "arm"),
        default=["global", "arm"],
        help="gradient sync modes to simulate",
    )
    p.add_argument(
        "--model-gb",
        type=float,
        default=2.0,
        help="fp32 main-param bytes of the modelled model per rank (GB), for the cost model",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    rows = []
    nbytes = args.model_gb * 1e9
    print(
        f"{'sync':>6} {'N':>5} {'arms':>5} {'per arm':>7} {'T':>5} {'lr/opt':>7} {'err oct':>7} "
        f"{'converge B/step':>15} {'vs DDP grad AR':>14} {'sim s':>6}"
    )
    for sync, n in ((s, n) for s in args.grad_sync for n in args.replicas):
        for per_arm in sorted({1, 8} if n >= 16 else {1}):
            arms = n // per_arm
            for period in args.periods:
                config = HDETConfig(
                    period=period, axes=(Axis("lr", 1 / 9),), temperature="auto", grad_sync=sync
                )
                ratios = []
                start = time.perf_counter()
                for seed in range(args.seeds):
                    opt = best_lr(replicas=n)
                    res = simulate(
                        config,
                        arms,
                        base_lr=opt / 4,
                        steps=period * args.windows,
                        replicas_per_arm=per_arm,
                        seed=seed,
                    )
                    ratios.append(res.final_lr / res.best_lr)
                seconds = time.perf_counter() - start
                ratio = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
                per_step = ring_bytes(arms, nbytes) / period
                row = {
                    "grad_sync": sync,
                    "replicas": n,
                    "arms": arms,
                    "replicas_per_arm": per_arm,
                    "period": period,
                    "final_lr_over_opt": ratio,
                    "error_octaves": abs(math.log2(ratio)),
                    "converge_bytes_per_step": per_step,
                    "converge_vs_ddp_grad_allreduce": per_step / ring_bytes(n, nbytes),
                    "sim_seconds": seconds,
                }
                rows.append(row)
                print(
                    f"{sync:>6} {n:5d} {arms:5d} {per_arm:7d} {period:5d} {ratio:7.2f} "
                    f"{row['error_octaves']:7.2f} {per_step / 1e6:12.1f} MB "
                    f"{row['converge_vs_ddp_grad_allreduce']:14.4f} {seconds:6.1f}",
                    flush=True,
                )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scale_sim.json"), "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
