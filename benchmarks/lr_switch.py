"""How early does a mis-set LR do lasting damage? Train at one LR, switch to another at iteration S.

    .venv/bin/python benchmarks/lr_switch.py --seed 1234 --from-scale 4 --at 5 10 20 40 60

Answers a question the quality benchmark (``quality.py``) raises: can *any* controller that
starts at a mis-set LR and corrects it after its first window(s) still end near the best sweep
point? An oracle is the upper bound of every controller: it trains plain Megatron
(``--no-hdet``) at ``from_scale * best`` and, at iteration S, jumps exactly to the best LR's
schedule. The runs:

- ``from``: ``from_scale * best`` for ``max(S)`` iterations, saving a (legacy ``torch`` format)
  checkpoint at every S; ``--lr-decay-iters`` keeps its schedule the full run's;
- ``switch-S``: resumed from that checkpoint with the best LR (``--override-opt-param-scheduler``)
  for the remaining iterations; compared with the same seed's ``sweep-x1`` run of ``quality.py``
  (same flags, same data order) when ``--sweep-dir`` has it, else with a ``to`` run made here.

Megatron-Core keys the optimizer's param groups by ``(wd_mult, lr_mult, max_lr, min_lr, ...)``
when it loads them (``MegatronOptimizer._filter_and_reorder_param_groups``), and
``OptimizerParamScheduler.get_lr`` takes a group's own ``max_lr`` / ``min_lr``; so a resume at
another peak LR first rewrites those two fields (and ``lr``) in the saved groups, on a copy of the
checkpoint. Everything else (weights, Adam moments, RNG, data position) is resumed as saved.
Results: ``lr_switch.json`` and a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from functools import reduce
from math import gcd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quality import (  # noqa: E402
    add_model_flags,
    default_data_prefix,
    lr_flags,
    model_args,
    read_run,
    run_one,
)

from hdet_megatron.run_files import SAVE_DIR_RULES, remove_files, walk  # noqa: E402


def retarget_checkpoint(src: str, dst: str, factor: float) -> None:
    """Copy a legacy-format checkpoint directory with every param group's LR fields scaled."""
    import torch

    shutil.copytree(src, dst, dirs_exist_ok=True)
    files = glob.glob(os.path.join(dst, "iter_*", "mp_rank_*", "model_optim_rng.pt"))
    if not files:
        raise SystemExit(f"{src}: no legacy-format checkpoint files (model_optim_rng.pt)")
    for path in files:
        state = torch.load(path, weights_only=False)
        for group in state["optimizer"]["param_groups"]:
            for key in ("max_lr", "min_lr", "lr"):
                group[key] = group[key] * factor
        torch.save(state, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--best-lr", type=float, default=2e-3, help="the best sweep LR (x1)")
    p.add_argument("--from-scale", type=float, default=4.0, help="the mis-set LR, in units of --best-lr")
    p.add_argument(
        "--at",
        type=int,
        nargs="+",
        default=[5, 10, 20, 40, 60],
        help="iterations at which to switch to the best LR",
    )
    add_model_flags(p, steps=500)
    p.add_argument(
        "--sweep-dir",
        default="benchmarks/results/quality",
        help="quality.py output holding sweep-x1-sSEED (same flags) to compare with",
    )
    p.add_argument("--out", default="benchmarks/results/lr_switch")
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    at = sorted(set(args.at))
    if not at or at[0] <= 0 or at[-1] >= args.steps:
        p.error(f"--at: every switch iteration must lie in 1..{args.steps - 1}")
    os.makedirs(args.out, exist_ok=True)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    base = model_args(args, default_data_prefix(), args.seed)
    # Megatron ties the decay length to --train-iters unless told: keep the full run's schedule.
    base += ["--lr-decay-iters", str(args.steps)]
    ckpt_flags = ["--ckpt-format", "torch"]

    tag = f"s{args.seed}"
    ref_dir = os.path.join(args.sweep_dir, f"sweep-x1-{tag}")
    ref = read_run(ref_dir)
    if ref is None:
        ref = run_one(
            f"to-x1-{tag}", base + lr_flags(args.best_lr) + ["--no-hdet"], args.out, args.force, log
        )
    ref_loss = ref["final"]["valid_loss"]

    from_lr = args.best_lr * args.from_scale
    name = f"from-x{args.from_scale:g}-{tag}"
    ckpt = os.path.join(args.out, name, "ckpt")
    short = list(base)
    short[short.index("--train-iters") + 1] = str(at[-1])
    missing = any(not os.path.isdir(os.path.join(ckpt, f"iter_{a:07d}")) for a in at)
    if missing or args.force:
        # This benchmark's own checkpoints of an earlier (partial, or --force) run: pretrain_gpt.py
        # refuses to --save among another run's checkpoints. Only checkpoint files go; anything
        # else in there stops the benchmark (nothing a user made is removed).
        if os.path.isdir(ckpt):
            files, dirs, stranger = walk(ckpt, SAVE_DIR_RULES)
            if stranger is not None:
                sys.exit(f"lr_switch.py: error: {stranger} is not a checkpoint file: move it out of {ckpt}")
            remove_files(files, dirs)
        # Save at every switch point: the save interval is their gcd.
        interval = reduce(gcd, at)
        run_one(
            name,
            short
            + lr_flags(from_lr)
            + ["--no-hdet", "--save", ckpt, "--save-interval", str(interval)]
            + ckpt_flags,
            args.out,
            True,
            log,
        )
    target = ckpt + "-retargeted"
    if not os.path.isdir(target) or args.force:
        retarget_checkpoint(ckpt, target, args.best_lr / from_lr)

    rows = []
    for s in at:
        res = run_one(
            f"switch-{s}-{tag}",
            base
            + lr_flags(args.best_lr)
            + [
                "--no-hdet",
                "--load",
                target,
                "--ckpt-step",
                str(s),
                "--override-opt-param-scheduler",
            ]
            + ckpt_flags,
            args.out,
            args.force,
            log,
        )
        loss = res["final"]["valid_loss"]
        rows.append({"switch_at": s, "valid_loss": loss, "vs_best": loss / ref_loss - 1})
    with open(os.path.join(args.out, f"lr_switch-x{args.from_scale:g}-{tag}.json"), "w") as f:
        json.dump({"settings": vars(args), "reference_valid_loss": ref_loss, "rows": rows}, f, indent=1)
    print(f"x{args.from_scale:g} -> x1 at iteration S (seed {args.seed}); best sweep point {ref_loss:.4f}")
    for r in rows:
        print(f"  S = {r['switch_at']:>4}: valid {r['valid_loss']:.4f}  {100 * r['vs_best']:+.2f}%")


if __name__ == "__main__":
    main()
